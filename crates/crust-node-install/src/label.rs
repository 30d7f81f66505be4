//! The node label that tells the scheduler crust is installed (the
//! RuntimeClass `crust` selects nodes by it), set after a successful
//! install and removed on uninstall, with one JSON merge patch of the
//! Node object through the API server, as the pod's service account.
//!
//! In cluster: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`,
//! the token and CA under `/var/run/secrets/kubernetes.io/serviceaccount/`
//! (RBAC: `get`/`patch` on `nodes`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ureq::tls::{PemItem, RootCerts, TlsConfig, parse_pem};

/// Label set on nodes where crust is installed.
pub const LABEL: &str = "crust.dev/runtime";
pub const LABEL_VALUE: &str = "installed";

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

#[derive(Debug, thiserror::Error)]
pub enum LabelError {
    #[error("no API server: set --api-server or run in a pod (KUBERNETES_SERVICE_HOST)")]
    NoApiServer,
    #[error("{0}: {1}")]
    Read(PathBuf, std::io::Error),
    #[error("CA bundle {0} holds no certificate")]
    NoCa(PathBuf),
    #[error("labelling node {node}: {reason}")]
    Patch { node: String, reason: String },
}

/// Where and as whom to reach the API server.
#[derive(Debug, Clone)]
pub struct ApiServer {
    /// `https://host:port` (or `http://` for a local test peer).
    pub url: String,
    pub token_file: PathBuf,
    /// None: the system roots (only meaningful for `http://`).
    pub ca_file: Option<PathBuf>,
}

impl ApiServer {
    /// The in-cluster API server, or `url` when given.
    pub fn in_cluster(url: Option<String>) -> Result<ApiServer, LabelError> {
        let url = match url {
            Some(u) => u,
            None => {
                let host = std::env::var("KUBERNETES_SERVICE_HOST")
                    .map_err(|_| LabelError::NoApiServer)?;
                let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or("443".into());
                // An IPv6 service address needs brackets.
                if host.contains(':') {
                    format!("https://[{host}]:{port}")
                } else {
                    format!("https://{host}:{port}")
                }
            }
        };
        let sa = Path::new(SA_DIR);
        Ok(ApiServer {
            ca_file: url.starts_with("https://").then(|| sa.join("ca.crt")),
            url,
            token_file: sa.join("token"),
        })
    }
}

/// Sets (`Some(value)`) or removes (`None`) `label` on `node`.
pub fn set_label(
    api: &ApiServer,
    node: &str,
    label: &str,
    value: Option<&str>,
) -> Result<(), LabelError> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| LabelError::Read(p.to_path_buf(), e));
    let token = String::from_utf8_lossy(&read(&api.token_file)?)
        .trim()
        .to_string();
    let mut tls = TlsConfig::builder();
    if let Some(ca) = &api.ca_file {
        let pem = read(ca)?;
        let certs: Vec<_> = parse_pem(&pem)
            .filter_map(|i| match i {
                Ok(PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            return Err(LabelError::NoCa(ca.clone()));
        }
        tls = tls.root_certs(RootCerts::Specific(Arc::new(certs)));
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(tls.build())
        .timeout_global(Some(Duration::from_secs(30)))
        .http_status_as_error(false)
        .build()
        .into();
    // JSON merge patch (RFC 7386): null deletes the key.
    let body = serde_json::json!({"metadata": {"labels": {label: value}}}).to_string();
    let url = format!("{}/api/v1/nodes/{node}", api.url.trim_end_matches('/'));
    let fail = |reason: String| LabelError::Patch {
        node: node.to_string(),
        reason,
    };
    let mut resp = agent
        .patch(&url)
        .header("Authorization", &format!("Bearer {token}"))
        .content_type("application/merge-patch+json")
        .send(body.as_str())
        .map_err(|e| fail(e.to_string()))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        return Err(fail(format!("{status}: {}", text.trim())));
    }
    Ok(())
}
