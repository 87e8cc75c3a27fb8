//! Router replicas sharing decisions and load over a real NATS server (`nats-server`, started
//! by each test on a free loopback port so that it can be killed and restarted): what one
//! replica learns another routes by, load held through one shapes the other's choice, the
//! backends' prefill lines are learned from every replica's answers, a request continuing a
//! prompt a peer has in flight counts that one as ended, a bus
//! outage loses no request and the replicas converge again, a new replica catches up from a
//! peer's snapshot, and foreign or broken messages are counted and ignored.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::{bus_key_file, eventually, fleet, instant, metric, router, text, Nats};
use serde_json::json;
use vllm_sim::{Fleet, SimConfig};

/// A router replica on the bus.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn replica(
    sims: &[String],
    bus: &str,
    extra: &[&str],
) -> (
    prefix_router::server::Running,
    std::sync::Arc<prefix_router::serve::Gateway>,
) {
    let key = bus_key_file();
    let mut words = vec![
        "--replica-bus",
        bus,
        "--replica-bus-subject",
        "test-fleet",
        "--replica-bus-key-file",
        key.as_str(),
    ];
    words.extend_from_slice(extra);
    router(sims, &words).await
}

async fn connected(url: &str) -> bool {
    metric(url, "prefix_router_replica_bus_connected", "").await == 1.0
}

async fn until_connected(urls: &[&str]) {
    for url in urls {
        assert!(
            eventually(20, || connected(url)).await,
            "{url} never connected to the bus"
        );
    }
}

/// Two replicas A and B of one fleet of `n` sims, connected to a bus of their own; `None`
/// (the test skips) where `nats-server` is not installed.
async fn pair(config: SimConfig, n: usize) -> Option<Pair> {
    let nats = Nats::start().await?;
    let sims = fleet(config, n).await;
    let (a, gw_a) = replica(&sims.urls(), &nats.url(), &[]).await;
    let (b, gw_b) = replica(&sims.urls(), &nats.url(), &[]).await;
    until_connected(&[&a.url(), &b.url()]).await;
    Some(Pair {
        nats,
        sims,
        a,
        gw_a,
        b,
        gw_b,
    })
}

struct Pair {
    nats: Nats,
    sims: Fleet,
    a: prefix_router::server::Running,
    gw_a: std::sync::Arc<prefix_router::serve::Gateway>,
    b: prefix_router::server::Running,
    gw_b: std::sync::Arc<prefix_router::serve::Gateway>,
}

/// Requests each sim has finished.
async fn served(sims: &Fleet) -> Vec<f64> {
    let mut out = Vec::new();
    for url in sims.urls() {
        out.push(metric(&url, "vllm:request_success_total", "").await);
    }
    out
}

async fn complete(router: &str, prompt: &str) -> u16 {
    reqwest::Client::new()
        .post(format!("{router}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// Sends `prompt` through `router`; returns the index of the sim that served it.
async fn serve_once(router: &str, sims: &Fleet, prompt: &str) -> usize {
    let before = served(sims).await;
    assert_eq!(complete(router, prompt).await, 200);
    let after = served(sims).await;
    let moved: Vec<usize> = (0..after.len()).filter(|&i| after[i] > before[i]).collect();
    assert_eq!(moved.len(), 1, "one sim served it: {before:?} -> {after:?}");
    moved[0]
}

/// Sends each prompt through `router`; returns the sim that served each.
async fn teach(router: &str, sims: &Fleet, prompts: &[String]) -> Vec<usize> {
    let mut placed = Vec::new();
    for p in prompts {
        placed.push(serve_once(router, sims, p).await);
    }
    placed
}

/// Asks `router` for the prompts again, in the reverse order (see [`prompts`]): each goes to
/// the sim it was `placed` on.
async fn routes_as_taught(router: &str, sims: &Fleet, prompts: &[String], placed: &[usize]) {
    for (p, &sim) in prompts.iter().zip(placed).rev() {
        assert_eq!(
            serve_once(router, sims, p).await,
            sim,
            "{router} routes where it was taught"
        );
    }
}

/// A replica's view of the backend at `url`.
fn backend_of(
    gw: &prefix_router::serve::Gateway,
    url: &str,
) -> std::sync::Arc<prefix_router::core::backend::Backend> {
    gw.core
        .fleet
        .snapshot()
        .iter()
        .find(|b| b.url() == url)
        .cloned()
        .unwrap()
}

/// Distinct long prompts (the string index matches them whole). Tests ask for them again in
/// the reverse order: unmatched requests rotate over equally loaded sims, so asking in the
/// same order would land them where they were even with nothing learned.
fn prompts(n: u64, seed: u64) -> Vec<String> {
    (0..n).map(|i| text(seed * 1000 + i, 6_000)).collect()
}

async fn received_decisions(url: &str) -> f64 {
    metric(url, "prefix_router_replica_bus_decisions_total", "received").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_taught_to_one_replica_is_routed_there_by_another() {
    let Some(Pair {
        nats: _nats,
        sims,
        a,
        b,
        ..
    }) = pair(instant(), 4).await
    else {
        return;
    };
    let taught = prompts(8, 1);
    let placed = teach(&a.url(), &sims, &taught).await;
    // The default policy places prompts nobody holds by load: A used several sims.
    let mut distinct = placed.clone();
    distinct.sort();
    distinct.dedup();
    assert!(
        distinct.len() >= 2,
        "A placed them all on one sim: {placed:?}"
    );
    let start = Instant::now();
    assert!(
        eventually(5, || async { received_decisions(&b.url()).await >= 8.0 }).await,
        "B never heard A's decisions"
    );
    eprintln!("B heard A's 8 decisions within {:?}", start.elapsed());
    routes_as_taught(&b.url(), &sims, &taught, &placed).await;
    // And the other way round.
    let back = prompts(4, 2);
    let placed = teach(&b.url(), &sims, &back).await;
    assert!(eventually(5, || async { received_decisions(&a.url()).await >= 4.0 }).await);
    routes_as_taught(&a.url(), &sims, &back, &placed).await;
}

/// A sim whose requests take seconds (a slow prefill), to hold load.
fn slow() -> SimConfig {
    SimConfig {
        prefill_tokens_per_s: 2_000.0,
        prefill_overhead_ms: 1.0,
        itl_ms: 1.0,
        ..SimConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_held_through_one_replica_steers_the_other() {
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(slow(), 2).await;
    let urls = sims.urls();
    // A knows only sim 0; B knows both, routes by load, and does not scrape the sims' own
    // queues (so what it knows of sim 0's load can only come from A, over the bus).
    let (a, _) = replica(&urls[..1], &nats.url(), &["--policy", "least_loaded"]).await;
    let (b, gw_b) = replica(
        &urls,
        &nats.url(),
        &["--policy", "least_loaded", "--metrics-interval", "1h"],
    )
    .await;
    until_connected(&[&a.url(), &b.url()]).await;
    // Three requests of ~3 s each through A, all on sim 0.
    let held: Vec<_> = (0..3)
        .map(|i| {
            let (url, prompt) = (a.url(), text(100 + i, 24_000));
            tokio::spawn(async move { complete(&url, &prompt).await })
        })
        .collect();
    let sim0 = backend_of(&gw_b, &urls[0]);
    assert!(
        eventually(5, || async { sim0.remote.inflight.load(Relaxed) == 3 }).await,
        "B never saw A's three requests on sim 0"
    );
    // B sends its short requests to sim 1, the one A's load left free.
    let before = served(&sims).await;
    for i in 0..4 {
        assert_eq!(complete(&b.url(), &text(200 + i, 400)).await, 200);
    }
    let after = served(&sims).await;
    assert_eq!(after[1] - before[1], 4.0, "{before:?} -> {after:?}");
    assert_eq!(
        after[0], before[0],
        "sim 0 was still busy with A's requests"
    );
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    // A's requests ended: its table says so, and B counts nothing for it any more.
    assert!(eventually(5, || async { sim0.remote.inflight.load(Relaxed) == 0 }).await);
}

/// Sends a streamed completion through `router` and reads it to the end.
async fn stream(router: &str, prompt: &str) -> u16 {
    let response = reqwest::Client::new()
        .post(format!("{router}/v1/completions"))
        .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    response.bytes().await.unwrap();
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_learns_the_backends_prefill_from_a_peers_answers() {
    let Some(Pair {
        nats: _nats,
        sims,
        a,
        gw_a,
        b,
        gw_b,
    }) = pair(slow(), 2).await
    else {
        return;
    };
    let urls = sims.urls();
    // Answers of several sizes through A alone; B serves nothing.
    for i in 0..12u64 {
        assert_eq!(
            stream(&a.url(), &text(300 + i, 500 + 700 * (i % 4) as usize)).await,
            200
        );
    }
    let learned = |gw: &prefix_router::serve::Gateway| -> Vec<u64> {
        urls.iter()
            .map(|u| backend_of(gw, u).prefill.observations())
            .collect()
    };
    assert_eq!(learned(&gw_a).iter().sum::<u64>(), 12);
    assert!(
        eventually(5, || async { learned(&gw_b) == learned(&gw_a) }).await,
        "B learned {:?} of A's {:?}",
        learned(&gw_b),
        learned(&gw_a)
    );
    assert_eq!(
        metric(
            &b.url(),
            "prefix_router_replica_bus_first_bytes_total",
            "received"
        )
        .await,
        12.0
    );
    // From the same answers, the same lines (the bus rounds times to microseconds).
    for u in urls
        .iter()
        .filter(|u| backend_of(&gw_a, u).prefill.observations() > 0)
    {
        let (la, lb) = (
            backend_of(&gw_a, u).prefill.line(),
            backend_of(&gw_b, u).prefill.line(),
        );
        let (ta, tb) = (la.ttft(2_000), lb.ttft(2_000));
        assert!((ta - tb).abs() <= 1e-3 * ta, "{u}: A {la:?}, B {lb:?}");
        assert_ne!(la, prefix_router::core::prefill::PrefillLine::default());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_continuing_a_peers_prompt_counts_that_one_as_ended() {
    let Some(Pair {
        nats: _nats,
        sims,
        a,
        b,
        gw_b,
        ..
    }) = pair(slow(), 2).await
    else {
        return;
    };
    let urls = sims.urls();
    let continued = || {
        let url = b.url();
        async move { metric(&url, "prefix_router_continued_elsewhere_total", "").await }
    };
    // A conversation's first turn through A, answering for ~3 s.
    let first = text(400, 3_000);
    let held = {
        let (url, prompt) = (a.url(), first.clone());
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .json(&json!({
                    "model": "sim-model", "prompt": prompt, "max_tokens": 3000, "ignore_eos": true
                }))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        })
    };
    let busy = || {
        urls.iter()
            .map(|u| backend_of(&gw_b, u).remote.inflight.load(Relaxed))
            .sum::<u64>()
    };
    assert!(
        eventually(5, || async { busy() == 1 }).await,
        "B never saw A's request"
    );
    // The same prompt again (a sibling) and an unrelated one continue nothing.
    assert_eq!(complete(&b.url(), &first).await, 200);
    assert_eq!(complete(&b.url(), &text(401, 3_000)).await, 200);
    assert_eq!(continued().await, 0.0);
    // The next turn, whose prompt holds the first turn's: A's request counts as ended.
    let second = format!(
        "{first} and the answer, then the next question {}",
        text(402, 400)
    );
    assert_eq!(complete(&b.url(), &second).await, 200);
    assert_eq!(continued().await, 1.0);
    assert_eq!(held.await.unwrap(), 200);
    // Once A has said it ended, there is nothing left to count as ended.
    assert!(eventually(5, || async { busy() == 0 }).await);
    assert_eq!(complete(&b.url(), &format!("{second} more")).await, 200);
    assert_eq!(continued().await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_outage_loses_no_request_and_the_replicas_converge_again() {
    let Some(Pair {
        mut nats,
        sims,
        a,
        b,
        ..
    }) = pair(instant(), 4).await
    else {
        return;
    };
    // Steady traffic through both replicas while the bus dies and returns.
    let load = {
        let (a, b) = (a.url(), b.url());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for i in 0..300u64 {
                let url = if i % 2 == 0 { &a } else { &b };
                statuses.push(complete(url, &text(5_000 + i % 40, 2_000)).await);
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let applied = |url: String| async move {
        metric(&url, "prefix_router_replica_bus_snapshots_total", "applied").await
    };
    let applied_before = applied(a.url()).await + applied(b.url()).await;
    let port = nats.port;
    nats.kill();
    assert!(
        eventually(10, || async {
            !connected(&a.url()).await && !connected(&b.url()).await
        })
        .await,
        "the replicas did not notice the bus going"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _nats = Nats::start_on(port, &[])
        .await
        .expect("nats-server restarts");
    let back = Instant::now();
    let statuses = load.await.unwrap();
    assert!(
        statuses.iter().all(|&s| s == 200),
        "every request succeeded through the outage: {:?}",
        statuses.iter().filter(|&&s| s != 200).count()
    );
    until_connected(&[&a.url(), &b.url()]).await;
    // Each replica asks for a snapshot on reconnecting; the one that reconnects second gets
    // the other's index.
    assert!(
        eventually(20, || async {
            applied(a.url()).await + applied(b.url()).await > applied_before
        })
        .await,
        "no snapshot merged after the bus returned"
    );
    eprintln!(
        "bus back: reconnected and a peer's index merged {:?} after nats-server restarted",
        back.elapsed()
    );
    assert!(
        metric(
            &a.url(),
            "prefix_router_replica_bus_dropped_total",
            "disconnected"
        )
        .await
            + metric(
                &b.url(),
                "prefix_router_replica_bus_dropped_total",
                "disconnected"
            )
            .await
            > 0.0,
        "decisions made during the outage are counted as not published"
    );
    // Converged: what A learns now, B routes by.
    let received = received_decisions(&b.url()).await;
    let fresh = prompts(6, 3);
    let placed = teach(&a.url(), &sims, &fresh).await;
    assert!(
        eventually(10, || async {
            received_decisions(&b.url()).await >= received + 6.0
        })
        .await
    );
    routes_as_taught(&b.url(), &sims, &fresh, &placed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_catches_up_from_a_peers_snapshot() {
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(instant(), 4).await;
    let (a, _) = replica(&sims.urls(), &nats.url(), &[]).await;
    until_connected(&[&a.url()]).await;
    let taught = prompts(8, 4);
    let placed = teach(&a.url(), &sims, &taught).await;
    // B starts after A learned everything, stops, and C starts in its place: each new
    // replica merges A's index on connecting.
    let (b, _) = replica(&sims.urls(), &nats.url(), &[]).await;
    let snapshot_applied = |url: String| async move {
        metric(&url, "prefix_router_replica_bus_snapshots_total", "applied").await >= 1.0
    };
    assert!(eventually(10, || snapshot_applied(b.url())).await);
    b.shutdown().await;
    let (c, _) = replica(&sims.urls(), &nats.url(), &[]).await;
    assert!(eventually(10, || snapshot_applied(c.url())).await);
    assert!(
        metric(
            &c.url(),
            "prefix_router_replica_bus_snapshot_entries_total",
            ""
        )
        .await
            > 0.0
    );
    assert_eq!(
        received_decisions(&c.url()).await,
        0.0,
        "C learned from the snapshot alone"
    );
    routes_as_taught(&c.url(), &sims, &taught, &placed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_and_broken_messages_are_counted_and_ignored() {
    use prefix_router::replica_bus::wire;
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(instant(), 2).await;
    let (a, gw_a) = replica(&sims.urls(), &nats.url(), &[]).await;
    until_connected(&[&a.url()]).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    // Frames signed with the fleet's key (what a peer could send), broken in every way.
    let key =
        prefix_router::replica_bus::auth::BusKey::from_file(std::path::Path::new(&bus_key_file()))
            .unwrap();
    let signed = |batch: &wire::Batch| wire::encode(batch, wire::Kind::Batch, Some(&key));
    let bomb = {
        let mut body = vec![wire::Kind::Batch as u8];
        body.extend_from_slice(&u32::MAX.to_le_bytes());
        let tag = key.tag(&[&wire::SIGNED_TAG, &body]);
        [&wire::SIGNED_TAG[..], &tag, &body].concat()
    };
    let mut truncated = signed(&wire::Batch {
        replica: 1,
        seq: 1,
        sent: vec![],
        load: None,
        unhealthy: vec![],
        first_bytes: vec![],
        ended: None,
        at_ms: Some(now_ms()),
    });
    truncated.truncate(6);
    let unknown_backend = signed(&wire::Batch {
        replica: 2,
        seq: 1,
        sent: vec![wire::Sent {
            backend: 12345,
            t_ms: u64::MAX,
            chunks: vec![1, 2, 3],
            blocks: None,
            bytes: Some(u64::MAX),
            block_size: None,
        }],
        load: Some(vec![wire::Load {
            backend: 12345,
            inflight: 5,
            waiting_first_byte: 5,
            queued_prefill_tokens: 5_000,
            queue_moved_ms_ago: Some(u64::MAX),
        }]),
        unhealthy: vec![12345],
        first_bytes: vec![wire::FirstByte {
            backend: 12345,
            ..Default::default()
        }],
        ended: Some(vec![wire::Ended {
            backend: 12345,
            last: 1,
        }]),
        at_ms: Some(now_ms()),
    });
    let sim0 = backend_of(&gw_a, &sims.urls()[0]);
    let implausible = signed(&wire::Batch {
        replica: 3,
        seq: 1,
        sent: vec![],
        load: None,
        unhealthy: vec![],
        first_bytes: vec![wire::FirstByte {
            backend: sim0.id,
            work: u64::MAX,
            uncached: 10,
            ttft_us: 1_000,
            ..Default::default()
        }],
        ended: None,
        at_ms: Some(now_ms()),
    });
    // A load table no replica can hold: refused whole.
    let implausible_load = signed(&wire::Batch {
        replica: 4,
        seq: 1,
        sent: vec![],
        load: Some(vec![wire::Load {
            backend: sim0.id,
            inflight: u64::MAX,
            waiting_first_byte: u64::MAX,
            queued_prefill_tokens: u64::MAX,
            queue_moved_ms_ago: None,
        }]),
        unhealthy: vec![],
        first_bytes: vec![],
        ended: None,
        at_ms: Some(now_ms()),
    });
    let not_a_batch = {
        let body = [
            &[wire::Kind::Batch as u8][..],
            &lz4_flex::compress_prepend_size(&rmp_serde::to_vec(&("not", "a", "batch")).unwrap()),
        ]
        .concat();
        let tag = key.tag(&[&wire::SIGNED_TAG, &body]);
        [&wire::SIGNED_TAG[..], &tag, &body].concat()
    };
    for payload in [
        b"{\"hello\": \"world\"}".to_vec(),
        bomb,
        truncated,
        not_a_batch,
        unknown_backend,
        implausible,
        implausible_load,
    ] {
        client.publish("test-fleet", payload.into()).await.unwrap();
    }
    client.flush().await.unwrap();
    let rejected = |reason: &'static str| {
        let url = a.url();
        async move { metric(&url, "prefix_router_replica_bus_rejected_total", reason).await }
    };
    // One decision, one health report and one first byte name a backend A does not have
    // (its load row is left out silently).
    assert!(eventually(5, || async { rejected("unknown_backend").await == 3.0 }).await);
    // A first byte of 2^64 - 1 tokens, a load table of 2^64 - 1 requests.
    assert!(eventually(5, || async { rejected("implausible").await == 2.0 }).await);
    assert_eq!(sim0.prefill.observations(), 0, "nothing learned from it");
    assert_eq!(
        sim0.remote.inflight.load(Relaxed),
        0,
        "no load taken from it"
    );
    // The JSON is no signed frame at all, and a frame cut short no longer verifies.
    assert_eq!(rejected("unauthenticated").await, 2.0);
    assert_eq!(rejected("too_large").await, 1.0);
    assert_eq!(rejected("malformed").await, 1.0);
    // The router still routes, and the bogus load counts for no backend it has.
    let p = text(77, 3_000);
    assert_eq!(complete(&a.url(), &p).await, 200);
}

/// A NATS server with a user and password: the router authenticates with the password from
/// a file (none in the URL), and one with the wrong password refuses to start with the
/// reason instead of running without a bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bus_authenticates_to_nats_and_refuses_to_start_when_refused() {
    let Some(nats) = Nats::start_with(&["--user", "router", "--pass", "s3cret-pass"]).await else {
        return;
    };
    let sims = fleet(instant(), 1).await;
    let dir = std::env::temp_dir().join(format!("bus-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    std::fs::write(&good, "s3cret-pass\n").unwrap();
    let (a, _) = replica(
        &sims.urls(),
        &nats.url(),
        &[
            "--replica-bus-user",
            "router",
            "--replica-bus-password-file",
            good.to_str().unwrap(),
        ],
    )
    .await;
    until_connected(&[&a.url()]).await;
    let bad = dir.join("bad");
    std::fs::write(&bad, "not-the-password").unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut words: Vec<String> = vec![
        "--listen".into(),
        listener.local_addr().unwrap().to_string(),
        "--backend".into(),
        sims.urls()[0].clone(),
    ];
    let key = bus_key_file();
    for w in [
        "--replica-bus",
        &nats.url(),
        "--replica-bus-key-file",
        &key,
        "--replica-bus-user",
        "router",
        "--replica-bus-password-file",
        bad.to_str().unwrap(),
    ] {
        words.push(w.to_owned());
    }
    let args = prefix_router::serve::ServeArgs::from_words(&words).unwrap();
    let err = match prefix_router::serve::spawn(args, listener).await {
        Ok(_) => panic!("a router the bus refuses must not start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("refused this router's credentials"), "{err}");
    assert!(
        !err.contains("not-the-password"),
        "the secret is not told: {err}"
    );
}

/// A stranger on an open NATS server cannot steer a keyed replica: frames it forges (health
/// reports, load rows, first bytes) are dropped and counted, a peer's genuine frame played
/// again is dropped, and its snapshot request goes unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_and_snapshot_requests_without_the_fleets_key_change_nothing() {
    use prefix_router::replica_bus::{auth::BusKey, wire};
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(instant(), 2).await;
    let urls = sims.urls();
    let (a, gw_a) = replica(&urls, &nats.url(), &[]).await;
    until_connected(&[&a.url()]).await;
    let sim0 = backend_of(&gw_a, &urls[0]);
    let sim1 = backend_of(&gw_a, &urls[1]);
    // Something for a snapshot to hold.
    for i in 0..4 {
        assert_eq!(complete(&a.url(), &text(900 + i, 2_000)).await, 200);
    }
    let stranger = async_nats::connect(nats.url()).await.unwrap();
    let forged = |key: Option<&BusKey>, replica: u64| {
        wire::encode(
            &wire::Batch {
                replica,
                seq: 1,
                sent: vec![],
                load: Some(vec![wire::Load {
                    backend: sim0.id,
                    inflight: 1_000,
                    waiting_first_byte: 1_000,
                    queued_prefill_tokens: 1 << 30,
                    queue_moved_ms_ago: None,
                }]),
                unhealthy: vec![sim0.id, sim1.id],
                first_bytes: vec![wire::FirstByte {
                    backend: sim0.id,
                    work: 10_000,
                    uncached: 10_000,
                    ttft_us: 100,
                    ..Default::default()
                }],
                ended: None,
                at_ms: Some(now_ms()),
            },
            wire::Kind::Batch,
            key,
        )
    };
    let other = BusKey::new(b"a key that is not the fleet's").unwrap();
    stranger
        .publish("test-fleet", forged(None, 7).into())
        .await
        .unwrap();
    stranger
        .publish("test-fleet", forged(Some(&other), 8).into())
        .await
        .unwrap();
    // A genuine peer frame, recorded and played again: the second copy is a replay.
    let key = BusKey::from_file(std::path::Path::new(&bus_key_file())).unwrap();
    let genuine = wire::encode(
        &wire::Batch {
            replica: 9,
            seq: 5,
            sent: vec![],
            load: None,
            unhealthy: vec![],
            first_bytes: vec![],
            ended: None,
            at_ms: Some(now_ms()),
        },
        wire::Kind::Batch,
        Some(&key),
    );
    stranger
        .publish("test-fleet", genuine.clone().into())
        .await
        .unwrap();
    stranger
        .publish("test-fleet", genuine.into())
        .await
        .unwrap();
    // A genuine frame recorded long ago.
    let old = wire::encode(
        &wire::Batch {
            replica: 10,
            seq: 1,
            sent: vec![],
            load: None,
            unhealthy: vec![],
            first_bytes: vec![],
            ended: None,
            at_ms: Some(now_ms() - 3_600_000),
        },
        wire::Kind::Batch,
        Some(&key),
    );
    stranger.publish("test-fleet", old.into()).await.unwrap();
    stranger.flush().await.unwrap();
    let url = a.url();
    let rejected = |reason: &'static str| {
        let url = url.clone();
        async move { metric(&url, "prefix_router_replica_bus_rejected_total", reason).await }
    };
    assert!(eventually(5, || async { rejected("unauthenticated").await == 2.0 }).await);
    assert!(eventually(5, || async { rejected("replayed").await == 1.0 }).await);
    assert!(eventually(5, || async { rejected("stale").await == 1.0 }).await);
    assert!(sim0.is_healthy() && sim1.is_healthy());
    assert_eq!(sim0.remote.inflight.load(Relaxed), 0);
    assert_eq!(sim0.prefill.observations(), 0);
    // An anonymous snapshot request: no answer (and one signed with another key neither).
    let asked = tokio::time::timeout(
        Duration::from_secs(2),
        stranger.request("test-fleet.snapshot", bytes::Bytes::new()),
    )
    .await;
    assert!(
        !matches!(asked, Ok(Ok(_))),
        "the index went to a stranger: {asked:?}"
    );
    assert_eq!(complete(&a.url(), &text(77, 2_000)).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_whose_bus_is_down_serves_from_local_state() {
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port();
    drop(free);
    let sims = fleet(instant(), 2).await;
    let (a, _) = replica(&sims.urls(), &format!("nats://127.0.0.1:{port}"), &[]).await;
    let p = text(88, 3_000);
    let first = serve_once(&a.url(), &sims, &p).await;
    assert_eq!(serve_once(&a.url(), &sims, &p).await, first);
    assert!(!connected(&a.url()).await);
    // The publisher counts the decisions it could not send at its next tick.
    let url = a.url();
    let dropped = || async {
        metric(
            &url,
            "prefix_router_replica_bus_dropped_total",
            "disconnected",
        )
        .await
            >= 2.0
    };
    assert!(eventually(5, dropped).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_one_replica_finds_down_leaves_the_others_candidates() {
    let Some(nats) = Nats::start().await else {
        return;
    };
    let sims = fleet(instant(), 2).await;
    let urls = sims.urls();
    let (a, _) = replica(&urls, &nats.url(), &[]).await;
    // B checks its backends hourly: what it learns of sim 0 going down comes from A.
    let (b, gw_b) = replica(
        &urls,
        &nats.url(),
        &["--health-interval", "1h", "--metrics-interval", "1h"],
    )
    .await;
    until_connected(&[&a.url(), &b.url()]).await;
    let sim0 = backend_of(&gw_b, &urls[0]);
    assert!(eventually(5, || async { sim0.is_healthy() }).await);
    reqwest::Client::new()
        .post(format!("{}/sim/kill", urls[0]))
        .send()
        .await
        .unwrap();
    assert!(
        eventually(5, || async { !sim0.is_healthy() }).await,
        "B never took A's word that sim 0 is down"
    );
    assert_eq!(
        metric(
            &b.url(),
            "prefix_router_replica_bus_health_reports_total",
            ""
        )
        .await,
        1.0
    );
    // B now routes everything to sim 1 without trying sim 0 first.
    for i in 0..4 {
        assert_eq!(complete(&b.url(), &text(300 + i, 1_000)).await, 200);
    }
    assert_eq!(
        metric(&b.url(), "prefix_router_retries_total", "").await,
        0.0
    );
}
