//! Registration cache (to be written).
