//! Who may call what: an API key for clients and an admin key for whatever changes routing
//! state. Keys are compared in constant time and never logged.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use crate::api_error::ApiError;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct AccessArgs {
    /// Clients must send `Authorization: Bearer <key>` (401 otherwise).
    #[arg(long, env = "PREFIX_ROUTER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file holding the API key (its first line), instead of `--api-key`.
    #[arg(long, env = "PREFIX_ROUTER_API_KEY_FILE", conflicts_with = "api_key")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Key for the operations that change routing state (the index's notify, capacity, drop and
    /// purge). Without it they are refused whenever an API key is set.
    #[arg(long, env = "PREFIX_ROUTER_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// A file holding the admin key, instead of `--admin-key`.
    #[arg(
        long,
        env = "PREFIX_ROUTER_ADMIN_KEY_FILE",
        conflicts_with = "admin_key"
    )]
    pub admin_key_file: Option<std::path::PathBuf>,
}

fn read_key(path: &std::path::Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read key file {}: {e}", path.display()))?;
    let key = text.lines().next().unwrap_or("").trim().to_owned();
    anyhow::ensure!(!key.is_empty(), "key file {} is empty", path.display());
    Ok(key)
}

/// The configured keys.
#[derive(Clone, Default)]
pub struct Keys {
    api: Option<Arc<[u8]>>,
    admin: Option<Arc<[u8]>>,
    /// The keys file's tenants (`--api-keys-file`): their keys are clients' keys too.
    tenants: Option<Arc<crate::tenants::Tenants>>,
}

impl AccessArgs {
    pub fn keys(&self) -> anyhow::Result<Keys> {
        let api = match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => Some(k.clone()),
            (None, Some(path)) => Some(read_key(path)?),
            (None, None) => None,
        };
        let admin = match (&self.admin_key, &self.admin_key_file) {
            (Some(k), _) => Some(k.clone()),
            (None, Some(path)) => Some(read_key(path)?),
            (None, None) => None,
        };
        for k in [&api, &admin].into_iter().flatten() {
            anyhow::ensure!(k.len() >= 8, "keys must have at least 8 characters");
        }
        Ok(Keys {
            api: api.map(|k| Arc::from(k.into_bytes())),
            admin: admin.map(|k| Arc::from(k.into_bytes())),
            tenants: None,
        })
    }
}

/// What a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Health checks and metrics.
    Open,
    /// Anything a client does.
    Client,
    /// Changes to routing state.
    Admin,
}

fn matches(given: &[u8], key: &Option<Arc<[u8]>>) -> bool {
    key.as_ref().is_some_and(|k| bool::from(given.ct_eq(k)))
}

impl Keys {
    /// These keys and the keys file's tenants.
    pub fn with_tenants(mut self, tenants: Arc<crate::tenants::Tenants>) -> Self {
        self.tenants = Some(tenants);
        self
    }

    pub fn is_open(&self) -> bool {
        self.api.is_none() && self.admin.is_none() && self.tenants.is_none()
    }

    /// Whether a request bearing `token` may do what `need` says; the error to answer if not.
    pub fn check(&self, need: Need, token: Option<&[u8]>) -> Result<(), ApiError> {
        let token = token.unwrap_or(b"");
        let unauthorized = || {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid API key (Authorization: Bearer <key>)",
            )
        };
        match need {
            Need::Open => Ok(()),
            Need::Client => match (&self.api, &self.admin, &self.tenants) {
                (None, _, None) => Ok(()),
                _ if matches(token, &self.api) || matches(token, &self.admin) => Ok(()),
                (_, _, Some(t)) if t.identify(token).is_some() => Ok(()),
                _ => Err(unauthorized()),
            },
            Need::Admin => match (&self.admin, &self.api) {
                (Some(_), _) if matches(token, &self.admin) => Ok(()),
                (Some(_), _) => Err(if matches(token, &self.api) {
                    ApiError::new(StatusCode::FORBIDDEN, "this operation needs the admin key")
                } else {
                    unauthorized()
                }),
                (None, Some(_)) => Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "this operation changes routing state and needs an admin key, which is not configured",
                )),
                (None, None) => Ok(()),
            },
        }
    }
}

impl Keys {
    /// A request's tenant (the keys file's, by its bearer token) and whether it may do what
    /// `need` says: for every front end.
    pub fn admit(
        &self,
        need: Need,
        headers: &axum::http::HeaderMap,
    ) -> Result<Option<Arc<crate::tenants::Tenant>>, ApiError> {
        // One digest per request: a tenant's key is a client's key (not an admin's).
        let tenant = self
            .tenants
            .as_ref()
            .and_then(|t| t.identify(bearer(headers)?));
        let tenant_passes = tenant.is_some() && need != Need::Admin;
        if !self.is_open() && !tenant_passes {
            self.check(need, bearer(headers))?;
        }
        Ok(tenant)
    }
}

fn bearer(headers: &axum::http::HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))
}

/// Middleware: `classify` says what each request needs.
pub async fn guard(
    keys: Keys,
    classify: fn(&Request) -> Need,
    req: Request,
    next: Next,
) -> Response {
    let tenant = match keys.admit(classify(&req), req.headers()) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let mut req = req;
    if let Some(tenant) = tenant {
        // The front end reads the tenant (priority, limits) from the request.
        req.extensions_mut().insert(tenant);
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(api: Option<&str>, admin: Option<&str>) -> Keys {
        AccessArgs {
            api_key: api.map(str::to_owned),
            admin_key: admin.map(str::to_owned),
            ..AccessArgs::default()
        }
        .keys()
        .unwrap()
    }

    #[test]
    fn rules() {
        let open = keys(None, None);
        assert!(open.check(Need::Admin, None).is_ok());
        let client_only = keys(Some("client-key"), None);
        assert!(client_only.check(Need::Client, Some(b"client-key")).is_ok());
        assert_eq!(
            client_only
                .check(Need::Client, Some(b"nope-nope"))
                .unwrap_err()
                .status,
            401
        );
        assert_eq!(
            client_only.check(Need::Client, None).unwrap_err().status,
            401
        );
        assert_eq!(
            client_only
                .check(Need::Admin, Some(b"client-key"))
                .unwrap_err()
                .status,
            403
        );
        assert!(client_only.check(Need::Open, None).is_ok());
        let both = keys(Some("client-key"), Some("admin-key"));
        assert!(both.check(Need::Admin, Some(b"admin-key")).is_ok());
        assert!(both.check(Need::Client, Some(b"admin-key")).is_ok());
        assert_eq!(
            both.check(Need::Admin, Some(b"client-key"))
                .unwrap_err()
                .status,
            403
        );
        let admin_only = keys(None, Some("admin-key"));
        assert!(admin_only.check(Need::Client, None).is_ok());
        assert_eq!(admin_only.check(Need::Admin, None).unwrap_err().status, 401);
        assert!(AccessArgs {
            api_key: Some("short".into()),
            ..AccessArgs::default()
        }
        .keys()
        .is_err());
    }
}
