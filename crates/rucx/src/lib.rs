//! rucx: a communication framework for clusters with heterogeneous GPUs
