//! Trace-driven simulator of the broker's placement on Alibaba's GPU
//! cluster trace v2023 ("openb"). See `docs/placement.md`.
//!
//! - [`trace`]: reading node and pod lists (errors name the line);
//! - [`sim`]: the cluster, the published static experiment and a dynamic
//!   replay, both through `rgpu_pool_broker::placement::place_in` with the
//!   broker's `Policy` implementations;
//! - [`pooling`]: the pooling experiment (GPUs on the pod's node or
//!   leased from any);
//! - [`report`]: CSV, SVG plots and the summary table.
pub mod pooling;
pub mod report;
pub mod sim;
pub mod trace;
