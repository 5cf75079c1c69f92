"""Running Triton Inference Server locally from the nvidia-pytriton wheel."""
