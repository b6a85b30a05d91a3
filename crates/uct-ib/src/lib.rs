//! rucx ib component (in progress).
