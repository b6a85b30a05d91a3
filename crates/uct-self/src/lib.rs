//! rucx self transport: loopback inside one process
