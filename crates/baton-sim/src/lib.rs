//! Discrete-event simulation of a Baton cluster (in progress).
