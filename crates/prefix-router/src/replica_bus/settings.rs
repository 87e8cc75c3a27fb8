//! Where the replica bus is, how the router proves itself to the NATS server (credentials,
//! TLS), and the fleet's shared key that proves each frame to the other replicas. Secrets come
//! from files or the environment, never from the URL, and are never logged.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::auth::BusKey;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReplicaBusArgs {
    /// Router replicas share their routing decisions and load over this NATS server
    /// (`nats://host:4222`, or `tls://` to require TLS). Each replica still routes from its
    /// own memory store: the request path never waits on the bus, and a bus outage leaves every
    /// replica routing on its own. Credentials go in the flags below, not in the URL.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS")]
    pub replica_bus: Option<String>,
    /// The bus's subject prefix: the replicas that share one see one fleet.
    #[arg(
        long,
        env = "PREFIX_ROUTER_REPLICA_BUS_SUBJECT",
        default_value = "prefix-router"
    )]
    pub replica_bus_subject: String,
    /// The fleet's shared key (a file of at least 16 bytes, e.g. `openssl rand -hex 32`):
    /// every frame carries an HMAC under it, and frames without a valid one are dropped and
    /// counted. Also seeds the chunk hashes when `--hash-seed` is not given. Required with
    /// `--replica-bus` unless `--replica-bus-insecure`.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_KEY_FILE")]
    pub replica_bus_key_file: Option<PathBuf>,
    /// Run the bus without a shared key: any client of the NATS server is then a trusted
    /// peer that can steer this router and read its index. Only for tests or a NATS server
    /// no one else can reach.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_INSECURE")]
    pub replica_bus_insecure: bool,
    /// NATS user name (with a password).
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_USER")]
    pub replica_bus_user: Option<String>,
    /// NATS password (prefer the environment variable or `--replica-bus-password-file`: a
    /// flag is visible to every user of the machine).
    #[arg(
        long,
        env = "PREFIX_ROUTER_REPLICA_BUS_PASSWORD",
        hide_env_values = true
    )]
    pub replica_bus_password: Option<String>,
    /// A file holding the NATS password.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_PASSWORD_FILE")]
    pub replica_bus_password_file: Option<PathBuf>,
    /// A file holding a NATS authentication token.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_TOKEN_FILE")]
    pub replica_bus_token_file: Option<PathBuf>,
    /// A NATS credentials file (JWT and NKey seed, as `nsc` writes it).
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_CREDS")]
    pub replica_bus_creds: Option<PathBuf>,
    /// A file holding a NATS NKey seed (`SU...`).
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_NKEY_FILE")]
    pub replica_bus_nkey_file: Option<PathBuf>,
    /// Require TLS to the NATS server.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_TLS")]
    pub replica_bus_tls: bool,
    /// CA certificate(s) (PEM) to verify the NATS server with (implies TLS).
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_TLS_CA")]
    pub replica_bus_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS, with `--replica-bus-tls-key`.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_TLS_CERT")]
    pub replica_bus_tls_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS.
    #[arg(long, env = "PREFIX_ROUTER_REPLICA_BUS_TLS_KEY")]
    pub replica_bus_tls_key: Option<PathBuf>,
}

/// How the router authenticates to the NATS server.
#[derive(Clone, Default)]
pub enum NatsAuth {
    #[default]
    None,
    UserPassword {
        user: String,
        password: String,
    },
    Token(String),
    Creds(PathBuf),
    NKey(String),
}

impl std::fmt::Debug for NatsAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NatsAuth::None => "none",
            NatsAuth::UserPassword { .. } => "user and password",
            NatsAuth::Token(_) => "token",
            NatsAuth::Creds(_) => "credentials file",
            NatsAuth::NKey(_) => "nkey",
        })
    }
}

/// TLS to the NATS server.
#[derive(Clone, Debug, Default)]
pub struct NatsTls {
    pub required: bool,
    pub ca: Option<PathBuf>,
    pub client: Option<(PathBuf, PathBuf)>,
}

/// Where the bus is, how to reach it, and the fleet's key.
#[derive(Clone, Debug)]
pub struct BusSettings {
    /// `nats://host:port` (no credentials in it).
    pub url: String,
    /// The subject prefix shared by the replicas of one fleet.
    pub subject: String,
    /// The fleet's shared key (None: `--replica-bus-insecure`).
    pub key: Option<BusKey>,
    pub auth: NatsAuth,
    pub tls: NatsTls,
}

impl BusSettings {
    /// An open bus at `url` (tests, a private NATS server).
    pub fn insecure(url: &str, subject: &str) -> Self {
        Self {
            url: url.to_owned(),
            subject: subject.to_owned(),
            key: None,
            auth: NatsAuth::None,
            tls: NatsTls::default(),
        }
    }

    /// The client options these settings ask for (credentials read from their files now).
    pub async fn connect_options(&self) -> anyhow::Result<async_nats::ConnectOptions> {
        let mut options = match &self.auth {
            NatsAuth::None => async_nats::ConnectOptions::new(),
            NatsAuth::UserPassword { user, password } => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            NatsAuth::Token(token) => async_nats::ConnectOptions::with_token(token.clone()),
            NatsAuth::NKey(seed) => async_nats::ConnectOptions::with_nkey(seed.clone()),
            NatsAuth::Creds(path) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .with_context(|| {
                    format!(
                        "--replica-bus-creds {}: not a NATS credentials file",
                        path.display()
                    )
                })?,
        };
        if self.tls.required {
            options = options.require_tls(true);
        }
        if let Some(ca) = &self.tls.ca {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.tls.client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(options)
    }
}

fn secret_file(flag: &str, path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{flag}: cannot read {}", path.display()))?;
    let secret = text.trim();
    anyhow::ensure!(!secret.is_empty(), "{flag}: {} is empty", path.display());
    Ok(secret.to_owned())
}

impl ReplicaBusArgs {
    /// The bus settings, when `--replica-bus` is given; an error names what is missing or
    /// contradictory.
    pub fn settings(&self) -> anyhow::Result<Option<BusSettings>> {
        let Some(url) = &self.replica_bus else {
            return Ok(None);
        };
        let (scheme, rest) = url.split_once("://").unwrap_or(("nats", url.as_str()));
        if !matches!(scheme, "nats" | "tls") {
            bail!("--replica-bus {url}: expected nats://host:port or tls://host:port");
        }
        let authority = rest.split('/').next().unwrap_or(rest);
        if authority.contains('@') {
            bail!(
                "--replica-bus: credentials in the URL are not used; give them with \
                 --replica-bus-user and --replica-bus-password-file (or the \
                 PREFIX_ROUTER_REPLICA_BUS_PASSWORD variable), --replica-bus-token-file, \
                 --replica-bus-creds or --replica-bus-nkey-file"
            );
        }
        let key = match (&self.replica_bus_key_file, self.replica_bus_insecure) {
            (Some(path), _) => Some(BusKey::from_file(path)?),
            (None, true) => None,
            (None, false) => bail!(
                "--replica-bus needs the fleet's shared key (--replica-bus-key-file, at least \
                 16 bytes, the same file for every replica): without it any client of the NATS \
                 server could steer this router and read its index. For a test or a NATS \
                 server no one else reaches, pass --replica-bus-insecure"
            ),
        };
        let password = match (&self.replica_bus_password, &self.replica_bus_password_file) {
            (Some(_), Some(_)) => bail!(
                "give the NATS password once: --replica-bus-password (or its variable) or --replica-bus-password-file"
            ),
            (Some(p), None) => Some(p.clone()),
            (None, Some(path)) => Some(secret_file("--replica-bus-password-file", path)?),
            (None, None) => None,
        };
        let mut auth = Vec::new();
        match (&self.replica_bus_user, password) {
            (Some(user), Some(password)) => auth.push(NatsAuth::UserPassword {
                user: user.clone(),
                password,
            }),
            (None, None) => {}
            (Some(_), None) => bail!("--replica-bus-user needs a password (--replica-bus-password-file or PREFIX_ROUTER_REPLICA_BUS_PASSWORD)"),
            (None, Some(_)) => bail!("a NATS password needs --replica-bus-user"),
        }
        if let Some(path) = &self.replica_bus_token_file {
            auth.push(NatsAuth::Token(secret_file(
                "--replica-bus-token-file",
                path,
            )?));
        }
        if let Some(path) = &self.replica_bus_creds {
            anyhow::ensure!(
                path.is_file(),
                "--replica-bus-creds: {} is not a file",
                path.display()
            );
            auth.push(NatsAuth::Creds(path.clone()));
        }
        if let Some(path) = &self.replica_bus_nkey_file {
            auth.push(NatsAuth::NKey(secret_file(
                "--replica-bus-nkey-file",
                path,
            )?));
        }
        if auth.len() > 1 {
            bail!("give one way to authenticate to NATS: a user and password, a token, a credentials file or an nkey");
        }
        let client = match (&self.replica_bus_tls_cert, &self.replica_bus_tls_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => bail!("--replica-bus-tls-cert and --replica-bus-tls-key go together"),
        };
        let tls = NatsTls {
            required: self.replica_bus_tls
                || scheme == "tls"
                || self.replica_bus_tls_ca.is_some()
                || client.is_some(),
            ca: self.replica_bus_tls_ca.clone(),
            client,
        };
        Ok(Some(BusSettings {
            url: url.clone(),
            subject: self.replica_bus_subject.clone(),
            key,
            auth: auth.pop().unwrap_or_default(),
            tls,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: &str) -> ReplicaBusArgs {
        ReplicaBusArgs {
            replica_bus: Some(url.to_owned()),
            replica_bus_subject: "s".into(),
            replica_bus_insecure: true,
            ..Default::default()
        }
    }

    fn error(a: &ReplicaBusArgs) -> String {
        format!("{:#}", a.settings().unwrap_err())
    }

    #[test]
    fn credentials_in_the_url_are_refused_with_the_way_to_give_them() {
        let e = error(&args("nats://u:secret@nats:4222"));
        assert!(e.contains("--replica-bus-user"), "{e}");
        assert!(!e.contains("secret"), "the secret is not repeated: {e}");
    }

    #[test]
    fn a_bus_without_a_key_needs_an_explicit_insecure() {
        let mut a = args("nats://nats:4222");
        a.replica_bus_insecure = false;
        let e = error(&a);
        assert!(e.contains("--replica-bus-key-file"), "{e}");
        assert!(e.contains("--replica-bus-insecure"), "{e}");
        let dir = std::env::temp_dir().join(format!("bus-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key");
        std::fs::write(&key, "0123456789abcdef0123456789abcdef\n").unwrap();
        a.replica_bus_key_file = Some(key);
        assert!(a.settings().unwrap().unwrap().key.is_some());
    }

    #[test]
    fn one_way_to_authenticate_and_its_parts_together() {
        let dir = std::env::temp_dir().join(format!("bus-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let mut a = args("nats://nats:4222");
        a.replica_bus_user = Some("router".into());
        assert!(error(&a).contains("needs a password"));
        a.replica_bus_password_file = Some(file("password", "s3cret\n"));
        let s = a.settings().unwrap().unwrap();
        assert!(
            matches!(&s.auth, NatsAuth::UserPassword { user, password } if user == "router" && password == "s3cret")
        );
        assert_eq!(
            format!("{s:?}").matches("s3cret").count(),
            0,
            "never in logs"
        );
        a.replica_bus_token_file = Some(file("token", "t0ken"));
        assert!(error(&a).contains("one way"));
        let mut t = args("tls://nats:4222");
        t.replica_bus_tls_cert = Some(file("cert", "x"));
        assert!(error(&t).contains("go together"));
        t.replica_bus_tls_cert = None;
        assert!(t.settings().unwrap().unwrap().tls.required);
        assert!(error(&args("http://nats:4222")).contains("nats://"));
    }
}
