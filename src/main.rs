//! The `rbdkit` command line.
fn main() {}
