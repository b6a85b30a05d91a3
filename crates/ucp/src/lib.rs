//! rucx protocols: contexts, workers, endpoints, tag matching, planner
