//! rbdkit's benchmark contender (being built).
fn main() {}
