//! A network namespace made by CNI's own plugins (bridge + host-local,
//! from Debian's containernetworking-plugins in /usr/lib/cni), as a
//! container manager makes a pod's: what the door-parity network tests
//! hand a sandbox.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

const CNI_DIR: &str = "/usr/lib/cni";

/// A network namespace set up by CNI's bridge plugin; CNI DEL, the
/// namespace and the bridge are removed on drop.
pub struct CniNamespace {
    name: String,
    bridge: String,
    conf: String,
    ipam_dir: PathBuf,
    /// CNI's answer: the pod's address (with prefix) and the gateway.
    pub address: String,
    pub gateway: String,
}

/// `ip ARGS` on the host; its stdout, panicking on failure.
pub fn ip(args: &[&str]) -> String {
    let o = Command::new("ip").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

impl CniNamespace {
    /// `tag` keeps concurrent tests apart; IPAM state lives under `dir`.
    pub fn new(dir: &Path, tag: &str) -> CniNamespace {
        let pid = std::process::id();
        let name = format!("crust-rt-{tag}-{pid}");
        let salt = tag
            .bytes()
            .fold(pid, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
        let bridge = format!("crt{}", salt % 1_000_000);
        let subnet = format!("10.{}.{}.0/24", 200 + salt % 50, salt / 50 % 250);
        let ipam_dir = dir.join("cni-ipam");
        let conf = json!({
            "cniVersion": "1.0.0",
            "name": format!("crust-rt-{tag}"),
            "type": "bridge",
            "bridge": bridge,
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": ipam_dir,
            },
        })
        .to_string();
        ip(&["netns", "add", &name]);
        let mut ns = CniNamespace {
            name,
            bridge,
            conf,
            ipam_dir,
            address: String::new(),
            gateway: String::new(),
        };
        let out = ns.cni("ADD");
        let answer: Value = serde_json::from_str(&out).unwrap();
        ns.address = answer["ips"][0]["address"].as_str().unwrap().to_string();
        ns.gateway = answer["ips"][0]["gateway"].as_str().unwrap().to_string();
        ns
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    fn cni(&self, command: &str) -> String {
        use std::io::Write;
        let mut child = Command::new(Path::new(CNI_DIR).join("bridge"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &self.name)
            .env("CNI_NETNS", self.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("CNI's bridge plugin (containernetworking-plugins)");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(self.conf.as_bytes())
            .unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "CNI {command}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The namespace's interfaces by name.
    pub fn links(&self) -> Vec<String> {
        let v: Value = serde_json::from_str(&ip(&["-n", &self.name, "-j", "link"])).unwrap();
        let mut names: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["ifname"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    }
}

impl Drop for CniNamespace {
    fn drop(&mut self) {
        if !self.address.is_empty() {
            let _ = std::panic::catch_unwind(|| self.cni("DEL"));
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
        let _ = std::fs::remove_dir_all(&self.ipam_dir);
    }
}
