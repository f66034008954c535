//! The transfer benchmark (to come).
