//! rucx gdr_copy transport: CPU-mapped GPU memory through gdrcopy
