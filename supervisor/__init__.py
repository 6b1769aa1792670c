"""The supervisor: owns processes, devices, logs and monitoring of one run."""
