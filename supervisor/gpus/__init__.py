"""All NVML access of the supervisor goes through this package (the GPU adapter)."""
