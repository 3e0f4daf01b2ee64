//! The op set: placeholder, filled in by the CPU forward work.
