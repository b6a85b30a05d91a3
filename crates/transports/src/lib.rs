//! the list of every rucx transport component, for contexts to discover
