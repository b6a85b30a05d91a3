//! rucx cuda_ipc transport: device<->device across processes on one host
