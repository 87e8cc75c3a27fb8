//! Prefill/decode disaggregation as vLLM's NixlConnector speaks it, and what it costs.
//!
//! Every simulated server speaks both sides, as vLLM does with `kv_role: kv_both`; which one
//! prefills and which one decodes is the router's choice. A request whose
//! `kv_transfer_params` say `do_remote_decode` is a prefill for another server: it runs as
//! usual (the router asks for one token) and its answer names the blocks it computed. A
//! request whose `kv_transfer_params` say `do_remote_prefill` brings those names: the server
//! pulls the blocks it lacks before it schedules the request — a handshake with that peer the
//! first time, then the blocks' bytes at the link's bandwidth — caches them, and computes only
//! what no block carried.
//!
//! The blocks are named by their hashes: a decode request whose prompt is not the one that
//! was prefilled (a router pairing the wrong requests) finds none of its own blocks among them
//! and computes its whole prompt, as a real server would produce garbage rather than a hit.

use std::collections::HashSet;

use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::config::SimConfig;
use crate::openai::SimError;

/// What a request's `kv_transfer_params` ask.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Transfer {
    /// Nothing: an ordinary request.
    #[default]
    None,
    /// Prefill for a decode elsewhere: the answer carries the blocks' names.
    ForRemoteDecode,
    /// Decode after a prefill elsewhere: pull these blocks from that peer.
    FromRemotePrefill {
        engine_id: String,
        block_ids: HashSet<u64>,
    },
}

fn flag(params: &Value, name: &str) -> bool {
    params.get(name).and_then(Value::as_bool).unwrap_or(false)
}

/// Reads a request body's `kv_transfer_params` (absent or null: none).
pub fn parse(body: &Value) -> Result<Transfer, SimError> {
    let params = match body.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(Transfer::None),
        Some(p @ Value::Object(_)) => p,
        Some(_) => {
            return Err(SimError::bad_request(
                "`kv_transfer_params` must be an object",
            ))
        }
    };
    if flag(params, "do_remote_decode") {
        return Ok(Transfer::ForRemoteDecode);
    }
    if !flag(params, "do_remote_prefill") {
        return Ok(Transfer::None);
    }
    let engine_id = params
        .get("remote_engine_id")
        .and_then(Value::as_str)
        .ok_or_else(|| SimError::bad_request("do_remote_prefill needs a remote_engine_id"))?;
    // vLLM nests the ids per KV-cache group; the simulator has one group.
    let ids = match params.get("remote_block_ids") {
        Some(Value::Array(ids)) => ids
            .iter()
            .flat_map(|v| match v {
                Value::Array(group) => group.iter().filter_map(Value::as_u64).collect(),
                v => v.as_u64().into_iter().collect::<Vec<_>>(),
            })
            .collect(),
        _ => {
            return Err(SimError::bad_request(
                "do_remote_prefill needs remote_block_ids",
            ))
        }
    };
    Ok(Transfer::FromRemotePrefill {
        engine_id: engine_id.to_owned(),
        block_ids: ids,
    })
}

/// The `kv_transfer_params` of a prefill's answer: where the decode server pulls the blocks
/// from, and which.
pub fn produced(
    engine_id: &str,
    addr: std::net::SocketAddr,
    block_ids: &[u64],
    tokens: usize,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": engine_id,
        "remote_request_id": null,
        "remote_block_ids": [block_ids],
        "remote_host": addr.ip().to_string(),
        "remote_port": addr.port(),
        "remote_num_tokens": tokens,
        "tp_size": 1,
    })
}

/// The peers this server has shaken hands with (the first pull from one pays the handshake).
#[derive(Default)]
pub struct Peers(Mutex<HashSet<String>>);

impl Peers {
    /// Whether `engine_id` is new (and from now on known).
    pub fn first_contact(&self, engine_id: &str) -> bool {
        self.0.lock().insert(engine_id.to_owned())
    }
}

/// Simulated seconds to pull `tokens` tokens' blocks, with the handshake if `first`.
pub fn pull_secs(config: &SimConfig, tokens: usize, first: bool) -> f64 {
    let bytes = tokens as f64 * config.kv_bytes_per_token as f64;
    let handshake = if first {
        config.kv_handshake_ms / 1000.0
    } else {
        0.0
    };
    handshake + bytes / (config.kv_transfer_gbps * 1e9)
}

/// How many of `own` (a prompt's block hashes, in order) the named blocks carry: the leading
/// run of them (a prefix is only usable from its start).
pub fn carried(own: &[u64], named: &HashSet<u64>) -> usize {
    own.iter().take_while(|h| named.contains(h)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_name_the_side() {
        assert_eq!(parse(&json!({})).unwrap(), Transfer::None);
        assert_eq!(
            parse(&json!({"kv_transfer_params": null})).unwrap(),
            Transfer::None
        );
        assert_eq!(
            parse(&json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}))
                .unwrap(),
            Transfer::ForRemoteDecode
        );
        let addr: std::net::SocketAddr = "127.0.0.1:8100".parse().unwrap();
        let answer = produced("sim-8100", addr, &[7, 8, 9], 50);
        let back = parse(&json!({ "kv_transfer_params": answer })).unwrap();
        assert_eq!(
            back,
            Transfer::FromRemotePrefill {
                engine_id: "sim-8100".into(),
                block_ids: [7, 8, 9].into_iter().collect(),
            }
        );
        for bad in [
            json!({"kv_transfer_params": 3}),
            json!({"kv_transfer_params": {"do_remote_prefill": true}}),
            json!({"kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "x"}}),
        ] {
            assert!(parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_a_leading_run_of_blocks_is_carried() {
        let named: HashSet<u64> = [1, 2, 4].into_iter().collect();
        assert_eq!(carried(&[1, 2, 3, 4], &named), 2);
        assert_eq!(carried(&[9, 1, 2], &named), 0);
    }

    #[test]
    fn a_pull_costs_its_bytes_and_the_first_handshake() {
        let config = SimConfig {
            kv_bytes_per_token: 1_000_000,
            kv_transfer_gbps: 1.0,
            kv_handshake_ms: 100.0,
            ..SimConfig::default()
        };
        // 1,000 tokens of 1 MB at 1 GB/s: one second, and the handshake once.
        assert!((pull_secs(&config, 1000, false) - 1.0).abs() < 1e-9);
        assert!((pull_secs(&config, 1000, true) - 1.1).abs() < 1e-9);
        let peers = Peers::default();
        assert!(peers.first_contact("a"));
        assert!(!peers.first_contact("a"));
    }
}
