//! rucx cuda_copy transport: host<->device copies on streams, pinned staging pool
