"""`accelerate launch --config_file` files that use the DeepSpeed configs next door."""
