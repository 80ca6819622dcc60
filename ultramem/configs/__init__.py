"""Launcher configs shipped with the package: DeepSpeed ZeRO JSON files and Accelerate YAML files."""
