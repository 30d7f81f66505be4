//! A process's capabilities from the OCI spec: all five sets, applied by
//! the init helper before `exec` (containers and execs alike).
//!
//! Order matters, as in runc: the bounding set is cut while the helper
//! still holds CAP_SETPCAP; keep-caps carries the permitted set across a
//! switch to a non-root user; effective/permitted/inheritable are set
//! after it, then the ambient set (which needs each cap permitted and
//! inheritable).

use crust_agent_proto::Capabilities;
use rustix::thread::{self, CapabilitySet, CapabilitySets};

/// The five sets, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sets {
    pub bounding: CapabilitySet,
    pub effective: CapabilitySet,
    pub permitted: CapabilitySet,
    pub inheritable: CapabilitySet,
    pub ambient: CapabilitySet,
}

fn parse_set(set: &str, names: &[String]) -> Result<CapabilitySet, String> {
    names.iter().try_fold(CapabilitySet::empty(), |acc, n| {
        n.strip_prefix("CAP_")
            .and_then(CapabilitySet::from_name)
            .map(|c| acc | c)
            .ok_or_else(|| format!("capabilities.{set}: unknown capability {n:?}"))
    })
}

impl Sets {
    /// Every name must be a `CAP_*` capability; the error names the set
    /// and the name.
    pub fn parse(c: &Capabilities) -> Result<Sets, String> {
        Ok(Sets {
            bounding: parse_set("bounding", &c.bounding)?,
            effective: parse_set("effective", &c.effective)?,
            permitted: parse_set("permitted", &c.permitted)?,
            inheritable: parse_set("inheritable", &c.inheritable)?,
            ambient: parse_set("ambient", &c.ambient)?,
        })
    }

    /// Drops from the bounding set every capability the kernel knows and
    /// the spec does not list; then keeps the permitted set across a user
    /// switch.
    pub fn limit_bounding(&self) -> Result<(), String> {
        for cap in known().iter() {
            if !self.bounding.contains(cap) {
                thread::remove_capability_from_bounding_set(cap)
                    .map_err(|e| format!("dropping {cap:?} from the bounding set: {e}"))?;
            }
        }
        thread::set_keep_capabilities(true).map_err(|e| format!("PR_SET_KEEPCAPS: {e}"))
    }

    /// Effective, permitted, inheritable, then ambient (after the user
    /// switch).
    pub fn apply(&self) -> Result<(), String> {
        thread::set_keep_capabilities(false).map_err(|e| format!("PR_SET_KEEPCAPS: {e}"))?;
        // Capabilities newer than the guest kernel are ignored, as runc does.
        let k = known();
        thread::set_capabilities(
            None,
            CapabilitySets {
                effective: self.effective & k,
                permitted: self.permitted & k,
                inheritable: self.inheritable & k,
            },
        )
        .map_err(|e| format!("capset: {e}"))?;
        thread::clear_ambient_capability_set().map_err(|e| format!("clearing ambient: {e}"))?;
        for cap in (self.ambient & k).iter() {
            thread::configure_capability_in_ambient_set(cap, true)
                .map_err(|e| format!("raising ambient {cap:?}: {e}"))?;
        }
        Ok(())
    }
}

/// The capabilities this kernel knows (PR_CAPBSET_READ answers EINVAL
/// beyond the last one; no /proc needed inside the container's root).
fn known() -> CapabilitySet {
    let mut k = CapabilitySet::empty();
    for bit in 0..64 {
        let c = CapabilitySet::from_bits_retain(1 << bit);
        if thread::capability_is_in_bounding_set(c).is_err() {
            break;
        }
        k |= c;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_per_set() {
        let c = Capabilities {
            bounding: vec!["CAP_NET_BIND_SERVICE".into(), "CAP_CHOWN".into()],
            ambient: vec!["CAP_CHECKPOINT_RESTORE".into()],
            ..Default::default()
        };
        let s = Sets::parse(&c).unwrap();
        assert_eq!(s.bounding.bits(), (1 << 10) | 1);
        assert_eq!(s.ambient.bits(), 1 << 40);
        assert!(s.effective.is_empty());
        for (bad, set) in [("CAP_BOGUS", "effective"), ("NET_ADMIN", "effective")] {
            let c = Capabilities {
                effective: vec![bad.into()],
                ..Default::default()
            };
            let e = Sets::parse(&c).unwrap_err();
            assert!(e.contains(set) && e.contains(bad), "{e}");
        }
    }
}
