//! rucx tcp transport and sockaddr connection manager
