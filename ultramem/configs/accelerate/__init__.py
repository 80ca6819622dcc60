"""`accelerate launch --config_file` files: DeepSpeed ZeRO-2/3 (using the DeepSpeed configs next door) and FSDP2."""
