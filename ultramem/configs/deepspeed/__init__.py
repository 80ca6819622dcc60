"""DeepSpeed ZeRO-2/ZeRO-3 configs; batch sizes and LR are "auto" so the Trainer arguments fill them in."""
