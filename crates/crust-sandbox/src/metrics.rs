//! `GET /metrics` on a sandbox's shim socket: what `kata-monitor` scrapes.
//! kata-monitor watches `/run/vc/sbs` and `/run/kata` (where crust links
//! each shim socket, [`crate::katashim`]), GETs `/metrics` from every
//! sandbox it knows from the CRI, decodes the body as Prometheus text
//! format 0.0.4 (`expfmt.TypeTextPlain`) and appends the labels
//! `sandbox_id`, `cri_uid`, `cri_name` and `cri_namespace` to every
//! sample, so none of those is used here.
//!
//! | family | type | labels | from |
//! |---|---|---|---|
//! | `crust_hypervisor_up` | gauge | | QEMU's process is alive |
//! | `crust_hypervisor_cpu_seconds_total` | counter | | QEMU's user + system time (`/proc/<pid>/stat`) |
//! | `crust_hypervisor_resident_memory_bytes` | gauge | | QEMU's RSS |
//! | `crust_hypervisor_threads` | gauge | | QEMU's threads |
//! | `crust_hypervisor_open_fds` | gauge | | QEMU's open descriptors |
//! | `crust_guest_up` | gauge | | the guest agent answers a ping |
//! | `crust_guest_uptime_seconds` | gauge | | the agent's uptime |
//! | `crust_volume_stats_{capacity,used,available}_bytes` | gauge | `volume_path`, `device` | the guest's statvfs of each volume |
//! | `crust_volume_stats_inodes{,_used,_free}` | gauge | `volume_path`, `device` | the same, inodes |
//! | `crust_volume_stats_health_status_abnormal` | gauge | `volume_path`, `device` | 1 when the guest reports the volume abnormal, or another host device exposes its data while the guest has it |
//!
//! A part that cannot be read (QEMU gone, the agent silent) is left out,
//! never reported as zero; the `*_up` gauges say why.

use std::fmt::Write;
use std::time::Duration;

use crust_agent_proto::AgentClient;

use crate::records::SandboxState;
use crate::stats::Unit;

/// What `/metrics` answers with.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Bound on each guest call of a scrape: kata-monitor gives a sandbox 3 s.
const GUEST_CALL_BOUND: Duration = Duration::from_secs(1);

type Pick = fn(&crate::stats::VolumeUsage) -> u64;
/// The volume usage families: name, unit, the figure, help.
const VOLUME_FAMILIES: [(&str, Unit, Pick, &str); 6] = [
    (
        "crust_volume_stats_capacity_bytes",
        Unit::Bytes,
        |u| u.total,
        "Size of the volume's filesystem, as the guest sees it.",
    ),
    (
        "crust_volume_stats_used_bytes",
        Unit::Bytes,
        |u| u.used,
        "Bytes used on the volume.",
    ),
    (
        "crust_volume_stats_available_bytes",
        Unit::Bytes,
        |u| u.available,
        "Bytes available on the volume.",
    ),
    (
        "crust_volume_stats_inodes",
        Unit::Inodes,
        |u| u.total,
        "Inodes of the volume's filesystem.",
    ),
    (
        "crust_volume_stats_inodes_used",
        Unit::Inodes,
        |u| u.used,
        "Inodes used.",
    ),
    (
        "crust_volume_stats_inodes_free",
        Unit::Inodes,
        |u| u.available,
        "Inodes free.",
    ),
];
/// The QEMU process's families (`qemu`: its figures while it runs).
fn hypervisor(out: &mut Text, qemu: Option<&ProcFigures>) {
    out.family(
        "crust_hypervisor_up",
        "gauge",
        "1 while the sandbox's QEMU runs.",
    );
    out.sample(
        "crust_hypervisor_up",
        &[],
        f64::from(u8::from(qemu.is_some())),
    );
    if let Some(p) = qemu {
        out.one(
            "crust_hypervisor_cpu_seconds_total",
            "counter",
            "CPU time QEMU used (user and system), in seconds.",
            p.cpu_seconds,
        );
        out.one(
            "crust_hypervisor_resident_memory_bytes",
            "gauge",
            "QEMU's resident memory.",
            p.rss_bytes as f64,
        );
        out.one(
            "crust_hypervisor_threads",
            "gauge",
            "QEMU's threads.",
            p.threads as f64,
        );
        out.one(
            "crust_hypervisor_open_fds",
            "gauge",
            "QEMU's open file descriptors.",
            p.open_fds as f64,
        );
    }
}

/// The sandbox's metrics in Prometheus text format 0.0.4. `agent` is None
/// when the sandbox has no guest (yet, or any more).
pub async fn sandbox_metrics(
    state: &SandboxState,
    agent: Option<&AgentClient>,
    alias: &crate::alias_watch::AliasWatch,
    timeout: Duration,
) -> String {
    let timeout = timeout.min(GUEST_CALL_BOUND);
    let mut out = Text::default();
    let qemu = state
        .qemu
        .as_ref()
        .filter(|q| q.alive())
        .and_then(|q| ProcFigures::read(q.pid));
    hypervisor(&mut out, qemu.as_ref());
    let Some(agent) = agent.filter(|_| qemu.is_some()) else {
        out.one(
            "crust_guest_up",
            "gauge",
            "1 while the guest agent answers.",
            0.0,
        );
        return out.0;
    };
    let ping = agent
        .call_with_timeout(crust_agent_proto::Ping {}, timeout)
        .await;
    out.one(
        "crust_guest_up",
        "gauge",
        "1 while the guest agent answers.",
        f64::from(u8::from(ping.is_ok())),
    );
    let Ok(ping) = ping else {
        return out.0;
    };
    out.one(
        "crust_guest_uptime_seconds",
        "gauge",
        "Time since the guest booted.",
        ping.uptime_ms as f64 / 1000.0,
    );
    let mut rows = Vec::new();
    for v in &state.volumes {
        // The stats a poll gets: an alias on the host makes it abnormal.
        match crate::alias_watch::stats(alias, agent, v, timeout).await {
            Ok(s) => rows.push((v, s)),
            Err(e) => tracing::debug!(target = %v.target, "metrics: {e}"),
        }
    }
    for (name, unit, pick, help) in VOLUME_FAMILIES {
        out.family(name, "gauge", help);
        for (v, s) in &rows {
            if let Some(u) = s.usage.iter().find(|u| u.unit == unit) {
                out.sample(name, &labels(v), pick(u) as f64);
            }
        }
    }
    let name = "crust_volume_stats_health_status_abnormal";
    out.family(
        name,
        "gauge",
        "1 when the guest reports the volume abnormal.",
    );
    for (v, s) in &rows {
        let abnormal = f64::from(u8::from(s.volume_condition.abnormal));
        out.sample(name, &labels(v), abnormal);
    }
    out.0
}

fn labels(v: &crate::records::Volume) -> [(&'static str, &str); 2] {
    [
        ("volume_path", v.target.as_str()),
        ("device", v.device.as_str()),
    ]
}

/// Text format 0.0.4, one family at a time (every sample of a family
/// follows its TYPE line).
#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape_label(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, value: f64) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// The format's label-value escapes: backslash, double quote, newline.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// What `/proc/<pid>` says about QEMU.
struct ProcFigures {
    cpu_seconds: f64,
    rss_bytes: u64,
    threads: u64,
    open_fds: u64,
}

impl ProcFigures {
    fn read(pid: i32) -> Option<ProcFigures> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which may hold spaces and ')'.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        // stat(5): utime 14, stime 15, num_threads 20, rss 24 (1-based,
        // counting pid and comm): here shifted by 3.
        let num = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        let page = rustix::param::page_size() as u64;
        let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        Some(ProcFigures {
            cpu_seconds: (num(11)? + num(12)?) as f64 / ticks,
            threads: num(17)?,
            rss_bytes: num(21)? * page,
            open_fds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of text format 0.0.4 that expfmt's decoder (kata-monitor)
    /// enforces, checked line by line: names and label names valid, values
    /// floats, each family's samples after its own TYPE line and together,
    /// and none of the labels kata-monitor appends.
    pub(crate) fn check_text_format(body: &str) -> Result<usize, String> {
        let valid_name = |n: &str| {
            !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let mut family = String::new();
        let mut seen = std::collections::HashSet::new();
        let mut samples = 0;
        for line in body.lines() {
            if let Some(t) = line.strip_prefix("# TYPE ") {
                let (name, kind) = t.split_once(' ').ok_or(format!("bad TYPE: {line}"))?;
                if !seen.insert(name.to_string()) {
                    return Err(format!("family {name} split or typed twice"));
                }
                if !["counter", "gauge", "untyped"].contains(&kind) {
                    return Err(format!("type {kind}"));
                }
                family = name.to_string();
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').ok_or(format!("no value: {line}"))?;
            value.parse::<f64>().map_err(|e| format!("{line}: {e}"))?;
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.strip_suffix('}').ok_or(format!("labels: {line}"))?),
                None => (series, ""),
            };
            if !valid_name(name) || name != family {
                return Err(format!("sample {name} outside its family ({family})"));
            }
            let mut rest = labels;
            while !rest.is_empty() {
                let (k, r) = rest.split_once("=\"").ok_or(format!("label: {line}"))?;
                if !valid_name(k)
                    || ["sandbox_id", "cri_uid", "cri_name", "cri_namespace"].contains(&k)
                {
                    return Err(format!("label {k}: {line}"));
                }
                let mut end = None;
                let mut esc = false;
                for (i, c) in r.char_indices() {
                    match (esc, c) {
                        (true, '\\' | '"' | 'n') => esc = false,
                        (true, _) => return Err(format!("escape in {line}")),
                        (false, '\\') => esc = true,
                        (false, '"') => {
                            end = Some(i);
                            break;
                        }
                        (false, '\n') => return Err(format!("raw newline in {line}")),
                        _ => {}
                    }
                }
                let end = end.ok_or(format!("unterminated label in {line}"))?;
                rest = r[end + 1..].strip_prefix(',').unwrap_or(&r[end + 1..]);
            }
            samples += 1;
        }
        Ok(samples)
    }

    #[tokio::test]
    async fn this_process_as_the_hypervisor_in_text_format() {
        let me = crate::records::ProcRef::current();
        let mut st = SandboxState::for_bundle_dir("sb", "/b".into());
        st.qemu = Some(me);
        let body = sandbox_metrics(&st, None, &Default::default(), Duration::from_secs(1)).await;
        let n = check_text_format(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
        assert_eq!(n, 6, "{body}");
        assert!(body.contains("\ncrust_hypervisor_up 1\n"), "{body}");
        assert!(body.contains("\ncrust_guest_up 0\n"), "{body}");
        let threads: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix("crust_hypervisor_threads "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(threads >= 1.0, "{body}");
        // Gone: only the up gauges, saying so.
        st.qemu = None;
        let body = sandbox_metrics(&st, None, &Default::default(), Duration::from_secs(1)).await;
        assert_eq!(check_text_format(&body), Ok(2), "{body}");
        assert!(body.contains("\ncrust_hypervisor_up 0\n"), "{body}");
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert!(check_text_format("# TYPE x gauge\nx{sandbox_id=\"a\"} 1\n").is_err());
        assert!(check_text_format("# TYPE x gauge\ny 1\n").is_err());
    }
}
