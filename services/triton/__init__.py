"""Running Triton Inference Server locally from the nvidia-pytriton wheel.

launcher.py  starts, watches and stops a local `tritonserver` for the model repository
"""
