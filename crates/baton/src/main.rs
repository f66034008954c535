//! The Baton binary.
fn main() {}
