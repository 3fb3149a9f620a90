//! kvroute-lab: a deterministic discrete-event simulation of a whole kvroute
//! cluster in virtual time, for comparing routing policies on equal terms on
//! a shared machine (issue 12).
//!
//! - engines: kvroute-sim's real scheduler and block pool ([`engine`]);
//! - routers: the router's real index and policies ([`router`], [`policies`]);
//! - sidecars: KV events translated to router keys, pushed in 100 ms batches,
//!   full syncs every 5 s, a loss rate ([`sidecar`]);
//! - arrivals: the [`workload`] library;
//! - [`cluster::run`] ties them together; [`measure`] and [`goodput`] say how
//!   it went; [`matrix`] runs many and writes the report;
//! - [`crosscheck`] replays a `kvroute-bench compare --trace` run, to check
//!   the lab against the real processes.
//!
//! Nothing reads a wall clock or an unseeded random source: the same seed
//! gives the same result, bit for bit.

pub mod cluster;
pub mod crosscheck;
pub mod engine;
pub mod gate;
pub mod goodput;
pub mod matrix;
pub mod measure;
pub mod plot;
pub mod policies;
pub mod prompt;
pub mod router;
pub mod sidecar;
pub mod time;
pub mod workload;
