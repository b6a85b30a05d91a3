//! rucx CUDA services: runtime-loaded driver and NVML, pointer classification, GPU-direct report
