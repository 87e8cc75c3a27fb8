//! prefix-router: a prefix-cache-aware, load-balancing router for vLLM fleets.
//!
//! The binary's subcommands live here as modules so that tests, `demo` and `bench` can run them
//! in-process.
#![forbid(unsafe_code)]

pub mod access;
pub mod api_error;
pub mod cli;
pub mod core;
pub mod duration;
pub mod epp;
pub mod http_metrics;
pub mod index;
pub mod index_client;
pub mod json_body;
pub mod metric_label;
pub mod replica_bus;
pub mod serve;
pub mod server;
pub mod store_args;
pub mod tenants;
pub mod traces;
pub mod upstream;
