//! rucx posix transport: shared memory between processes on one host
