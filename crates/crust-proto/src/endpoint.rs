//! CSI-style endpoints: `unix:///path/to/socket` (what kubelet and the
//! sidecars use) or `http://host:port` for TCP.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint as TonicEndpoint, Uri};

/// Where `crust-csi` serves CSI unless told otherwise, and where
/// `crustctl` looks for it: one value so the two always meet.
pub const DEFAULT_CSI_ENDPOINT: &str = "unix:///run/crust-csi/csi.sock";

/// A parsed `--endpoint` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {0:?}: expected unix:///absolute/path or http://host:port")]
    Invalid(String),
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
}

impl Endpoint {
    /// Parses `unix:///abs/path`, `unix:/abs/path`, a bare absolute path, or
    /// `http(s)://...`.
    pub fn parse(s: &str) -> Result<Endpoint, EndpointError> {
        let path = if let Some(rest) = s.strip_prefix("unix://") {
            rest
        } else if let Some(rest) = s.strip_prefix("unix:") {
            rest
        } else if s.starts_with("http://") || s.starts_with("https://") {
            return Ok(Endpoint::Tcp(s.to_string()));
        } else {
            s
        };
        if !path.starts_with('/') || path.contains('\0') {
            return Err(EndpointError::Invalid(s.to_string()));
        }
        Ok(Endpoint::Unix(PathBuf::from(path)))
    }

    /// The socket path of a unix endpoint.
    pub fn unix_path(&self) -> Option<&Path> {
        match self {
            Endpoint::Unix(p) => Some(p),
            Endpoint::Tcp(_) => None,
        }
    }

    /// Opens a gRPC channel (connects eagerly so errors surface here).
    pub async fn connect(&self) -> Result<Channel, EndpointError> {
        match self {
            Endpoint::Unix(path) => {
                let path = path.clone();
                // The URI is ignored by the connector; tonic needs one anyway.
                TonicEndpoint::from_static("http://[::]:50051")
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            let stream = tokio::net::UnixStream::connect(path).await?;
                            Ok::<_, std::io::Error>(TokioIo::new(stream))
                        }
                    }))
                    .await
                    .map_err(|source| EndpointError::Connect {
                        endpoint: self.to_string(),
                        source,
                    })
            }
            Endpoint::Tcp(uri) => TonicEndpoint::from_shared(uri.clone())
                .map_err(|_| EndpointError::Invalid(uri.clone()))?
                .connect()
                .await
                .map_err(|source| EndpointError::Connect {
                    endpoint: self.to_string(),
                    source,
                }),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
            Endpoint::Tcp(u) => f.write_str(u),
        }
    }
}

impl std::str::FromStr for Endpoint {
    type Err = EndpointError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Endpoint::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_csi_forms() {
        assert_eq!(
            Endpoint::parse("unix:///csi/csi.sock").unwrap(),
            Endpoint::Unix("/csi/csi.sock".into())
        );
        assert_eq!(
            Endpoint::parse("unix:/csi/csi.sock").unwrap(),
            Endpoint::Unix("/csi/csi.sock".into())
        );
        assert_eq!(
            Endpoint::parse("/run/x.sock").unwrap(),
            Endpoint::Unix("/run/x.sock".into())
        );
        assert!(matches!(
            Endpoint::parse("http://127.0.0.1:1").unwrap(),
            Endpoint::Tcp(_)
        ));
        assert!(Endpoint::parse("unix://relative.sock").is_err());
        assert!(Endpoint::parse("csi.sock").is_err());
    }
}
