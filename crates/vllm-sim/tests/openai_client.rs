//! The simulator parsed by a real OpenAI client (the `openai` Python package).

mod support;

use std::net::SocketAddr;

use vllm_sim::{Fleet, SimConfig};

#[tokio::test]
async fn the_openai_python_client_reads_every_endpoint() {
    let Some(python) = support::python_with_openai() else {
        return;
    };
    let config = SimConfig {
        time_scale: 0.0,
        ..SimConfig::default()
    };
    let fleet = Fleet::start(config, 1, SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = support::run_python(&python, script, &[&fleet.urls()[0], "sim-model"]).await;
    assert!(out.contains("models ok"), "{out}");
    fleet.shutdown().await;
}
