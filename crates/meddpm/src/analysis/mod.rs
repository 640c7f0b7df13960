//! Performance analysis: ncu CSV parsing, GPU table, roofline (being written).
