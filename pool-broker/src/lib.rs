//! The GPU pool broker. Its inventory, leases and placement arrive with the
//! broker issue; until then the crate only reserves its place in the
//! workspace, and exports nothing that could be mistaken for a feature.
