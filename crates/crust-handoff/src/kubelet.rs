//! kubelet's directory layout, the one place crust reads it from a path's
//! shape (facts from kubelet's `pkg/kubelet` and `pkg/volume/util/subpath`):
//!
//! - a CSI volume is published at
//!   `<root>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`;
//! - a container's subPath of a volume is `<volume>/<sub>`, which kubelet
//!   creates (directories, `mkdirat` one by one) and then bind-mounts,
//!   by descriptor, at `<root>/pods/<uid>/volume-subpaths/<volume
//!   name>/<container>/<mount index>`: that bind, never `<volume>/<sub>`,
//!   is the container's mount source.
//!
//! The kubelet root differs between distributions (`/var/lib/kubelet`,
//! k0s' `/var/lib/k0s/kubelet`, microk8s' `.../common/var/lib/kubelet`),
//! so it is read from the paths kubelet hands over, never assumed.

/// kubelet's directory of subPath binds inside a pod's directory.
pub const VOLUME_SUBPATHS: &str = "volume-subpaths";
/// kubelet's directory of volumes inside a pod's directory.
pub const VOLUMES: &str = "volumes";

/// A path beneath a pod's directory, split at kubelet's layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodPath<'a> {
    /// `<root>/pods`.
    pub pods_dir: &'a str,
    pub uid: &'a str,
    /// The layer under the pod's directory (`volumes`, `volume-subpaths`,
    /// `etc-hosts`, `containers`, ...).
    pub layer: &'a str,
    /// What follows the layer (may be empty).
    pub rest: &'a str,
}

impl PodPath<'_> {
    /// `<root>/pods/<uid>`.
    pub fn pod_dir(&self) -> String {
        format!("{}/{}", self.pods_dir, self.uid)
    }
}

fn plain(c: &str) -> bool {
    !c.is_empty() && c != "." && c != ".."
}

/// Splits an absolute, normalized `path` of the form
/// `<root>/pods/<uid>/<layer>[/<rest>]`. `uid`: only that pod's paths.
/// The first `/pods/` that fits wins; a path with `.` or `..` components
/// or empty components is never split.
pub fn pod_path<'a>(path: &'a str, uid: Option<&str>) -> Option<PodPath<'a>> {
    if !path.starts_with('/') || path.split('/').skip(1).any(|c| !plain(c)) {
        return None;
    }
    let mut from = 0;
    while let Some(i) = path[from..].find("/pods/") {
        let at = from + i;
        let after = &path[at + "/pods/".len()..];
        let mut parts = after.splitn(3, '/');
        if let (Some(u), Some(layer)) = (parts.next(), parts.next())
            && uid.is_none_or(|want| want == u)
        {
            return Some(PodPath {
                pods_dir: if at == 0 {
                    "/pods"
                } else {
                    &path[..at + "/pods".len()]
                },
                uid: u,
                layer,
                rest: parts.next().unwrap_or(""),
            });
        }
        from = at + 1;
    }
    None
}

/// For a source under kubelet's pod directory
/// (`<kubelet_root>/pods/<uid>/volumes/...`), the `.../volumes` layer that
/// bounds [`crate::Store::find_for_source`]. None for any other source.
pub fn kubelet_volumes_layer(source: &str, kubelet_root: &str) -> Option<String> {
    let kubelet_root = kubelet_root.trim_end_matches('/');
    let rest = source.strip_prefix(kubelet_root)?.strip_prefix("/pods/")?;
    let (uid, rest) = rest.split_once('/')?;
    if uid.is_empty() || uid == "." || uid == ".." {
        return None;
    }
    if rest != VOLUMES && !rest.starts_with("volumes/") {
        return None;
    }
    Some(format!("{kubelet_root}/pods/{uid}/{VOLUMES}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_layer() {
        let src = "/var/lib/kubelet/pods/1234-ab/volumes/kubernetes.io~csi/pv1/mount/sub";
        assert_eq!(
            kubelet_volumes_layer(src, "/var/lib/kubelet").as_deref(),
            Some("/var/lib/kubelet/pods/1234-ab/volumes")
        );
        assert_eq!(
            kubelet_volumes_layer(src, "/var/lib/kubelet/").as_deref(),
            Some("/var/lib/kubelet/pods/1234-ab/volumes")
        );
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/x/etc-hosts", "/var/lib/kubelet"),
            None
        );
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/x/volumesx/a", "/var/lib/kubelet"),
            None
        );
        assert_eq!(kubelet_volumes_layer("/srv/a", "/var/lib/kubelet"), None);
        assert_eq!(
            kubelet_volumes_layer("/var/lib/kubelet/pods/../volumes/a", "/var/lib/kubelet"),
            None
        );
    }

    #[test]
    fn pod_paths_of_any_kubelet_root() {
        let p = pod_path(
            "/var/lib/k0s/kubelet/pods/u-1/volume-subpaths/data/app/0",
            None,
        )
        .unwrap();
        assert_eq!(p.pods_dir, "/var/lib/k0s/kubelet/pods");
        assert_eq!(
            (p.uid, p.layer, p.rest),
            ("u-1", VOLUME_SUBPATHS, "data/app/0")
        );
        assert_eq!(p.pod_dir(), "/var/lib/k0s/kubelet/pods/u-1");
        let v = pod_path("/k/pods/u/volumes", Some("u")).unwrap();
        assert_eq!((v.layer, v.rest), (VOLUMES, ""));
        // A directory named pods inside a volume does not fool a uid match.
        let nested = "/k/pods/u/volumes/x/pv/mount/pods/evil/volumes/y";
        assert_eq!(
            pod_path(nested, Some("u")).unwrap().rest,
            "x/pv/mount/pods/evil/volumes/y"
        );
        assert_eq!(
            pod_path(nested, Some("evil")).unwrap().pods_dir,
            "/k/pods/u/volumes/x/pv/mount/pods"
        );
        assert_eq!(pod_path("/k/pods/u", None), None, "no layer");
        assert_eq!(pod_path("/k/pods/other/volumes/a", Some("u")), None);
        for bad in [
            "/k/pods/../volumes/a",
            "/k/pods/u/./volumes",
            "/k//pods/u/volumes",
            "k/pods/u/volumes",
        ] {
            assert_eq!(pod_path(bad, None), None, "{bad}");
        }
    }
}
