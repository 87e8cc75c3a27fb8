//! A remote `prefix-router index` as a [`PrefixStore`]: how several router replicas share one
//! view of the fleet's caches.
//!
//! The router hashes each request once and sends the hashes (much smaller than the text), so
//! the index must chunk and seed as the router does; [`IndexClient::connect`] checks that.

use std::time::Duration;

use async_trait::async_trait;
use axum::http::{header, Method, Request, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use prefix_index::{
    NotifyOutcome, PrefixHasher, PrefixHashes, PrefixStore, QueryOutcome, ServerId, ServerInfo,
    StoreError, Tick,
};
use serde_json::{json, Value};

pub struct IndexClient {
    base: String,
    /// `Bearer <key>` for an index that requires keys.
    authorization: Option<axum::http::HeaderValue>,
    client: crate::upstream::HttpClient,
    timeout: Duration,
}

impl IndexClient {
    /// Connects to the index at `url` and checks that it hashes as `hasher` does.
    pub async fn connect(
        url: &str,
        hasher: PrefixHasher,
        timeout: Duration,
        key: Option<&str>,
    ) -> anyhow::Result<Self> {
        let authorization = key
            .map(|k| axum::http::HeaderValue::from_str(&format!("Bearer {k}")))
            .transpose()
            .map_err(|_| anyhow::anyhow!("the index key is not a valid header value"))?;
        let client = Self {
            base: url.trim_end_matches('/').to_owned(),
            authorization,
            // Its 4 s idle limit also stays below the index's own 10 s keep-alive.
            client: crate::upstream::client(timeout),
            timeout,
        };
        let answer = client
            .call(
                Method::POST,
                "/v1/compatibility",
                Some(json!({"chunk_size": hasher.chunk_size(), "hash_fingerprint": hasher.fingerprint()})),
            )
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the index at {url}: {e}"))?;
        anyhow::ensure!(
            answer["compatible"] == true,
            "the index at {url} hashes differently (its chunk size is {}, ours {}; or the hash seeds differ): give both the same --chunk-size and --hash-seed",
            answer["chunk_size"],
            hasher.chunk_size()
        );
        Ok(client)
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, StoreError> {
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes))
            .map_err(|e| StoreError::InvalidArgument(e.to_string()))?;
        if let Some(auth) = &self.authorization {
            req.headers_mut()
                .insert(header::AUTHORIZATION, auth.clone());
        }
        let exchange = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| StoreError::Unavailable(e.to_string()))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), 64 << 20)
                .collect()
                .await
                .map_err(|e| StoreError::Unavailable(e.to_string()))?
                .to_bytes();
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if status.is_success() {
                Ok(value)
            } else {
                let message = value["error"]["message"]
                    .as_str()
                    .unwrap_or("no message")
                    .to_owned();
                Err(match status {
                    StatusCode::BAD_REQUEST => StoreError::InvalidArgument(message),
                    _ => StoreError::Unavailable(format!("{status}: {message}")),
                })
            }
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout.as_millis() as u64))?
    }
}

fn count(v: &Value, key: &str) -> Result<u64, StoreError> {
    v[key]
        .as_u64()
        .ok_or_else(|| StoreError::Unavailable(format!("the index answered without `{key}`")))
}

#[async_trait]
impl PrefixStore for IndexClient {
    async fn notify(
        &self,
        hashes: &PrefixHashes,
        server: ServerId,
        t: Tick,
    ) -> Result<NotifyOutcome, StoreError> {
        let v = self
            .call(
                Method::POST,
                "/v1/notify",
                Some(json!({"hashes": hashes.as_slice(), "server_id": server, "t": t.secs()})),
            )
            .await?;
        Ok(NotifyOutcome {
            chunks: count(&v, "chunks")?,
            inserted: count(&v, "inserted")?,
            evicted: count(&v, "evicted")?,
        })
    }

    async fn query(
        &self,
        hashes: &PrefixHashes,
        candidates: &[ServerId],
        t: Tick,
    ) -> Result<QueryOutcome, StoreError> {
        prefix_index::store::check_candidates(candidates)?;
        let v = self
            .call(
                Method::POST,
                "/v1/query",
                Some(json!({"hashes": hashes.as_slice(), "server_ids": candidates, "t": t.secs()})),
            )
            .await?;
        let matches = v["matches"]
            .as_array()
            .ok_or_else(|| StoreError::Unavailable("the index answered without `matches`".into()))?
            .iter()
            .map(|m| count(m, "matched_chunks"))
            .collect::<Result<Vec<_>, _>>()?;
        if matches.len() != candidates.len() {
            return Err(StoreError::Unavailable(
                "the index answered for other servers".into(),
            ));
        }
        Ok(QueryOutcome::from_matches(
            candidates,
            matches,
            count(&v, "total_chunks")?,
        ))
    }

    async fn drop_server(&self, server: ServerId) -> Result<u64, StoreError> {
        let v = self
            .call(Method::DELETE, &format!("/v1/servers/{server}"), None)
            .await?;
        count(&v, "removed")
    }

    async fn set_capacity(&self, server: ServerId, capacity: u64) -> Result<u64, StoreError> {
        let v = self
            .call(
                Method::PUT,
                &format!("/v1/servers/{server}"),
                Some(json!({"capacity": capacity})),
            )
            .await?;
        count(&v, "evicted")
    }

    async fn servers(&self) -> Result<Vec<ServerInfo>, StoreError> {
        let v = self.call(Method::GET, "/v1/servers", None).await?;
        v["servers"]
            .as_array()
            .ok_or_else(|| StoreError::Unavailable("the index answered without `servers`".into()))?
            .iter()
            .map(|s| {
                Ok(ServerInfo {
                    server_id: count(s, "server_id")?,
                    entries: count(s, "chunks")?,
                    capacity: count(s, "capacity")?,
                })
            })
            .collect()
    }

    async fn purge_expired(&self, now: Tick) -> Result<u64, StoreError> {
        let v = self
            .call(Method::POST, "/v1/purge", Some(json!({"t": now.secs()})))
            .await?;
        count(&v, "purged")
    }

    fn kind(&self) -> &'static str {
        "index"
    }
}
