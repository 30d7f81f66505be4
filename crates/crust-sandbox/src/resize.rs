//! In-place resize of a running container (task `Update`, which CRI's
//! UpdateContainerResources sends with the container's whole
//! `LinuxResources`): the container's cgroup in the guest follows, and the
//! VM grows or shrinks so that it still covers the pod.
//!
//! | change | the VM | the guest |
//! |---|---|---|
//! | memory up | balloon deflated first, then DIMMs hot-added (128 MiB blocks, up to maxmem and [`crust_vmm::MEMORY_SLOTS`]) | `memory.max` raised after |
//! | memory down | balloon inflated to what the pod now needs, only as far as the guest can give back (`MemAvailable`) | `memory.max` lowered first (refused if the container holds more) |
//! | CPU | vCPUs hot-plugged and onlined when the pod's quotas add up to more (never unplugged; up to maxcpus) | `cpu.max` |
//!
//! Everything is planned against the bookkeeping ([`Sizing`]) and the
//! guest's figures before anything changes; a step that fails undoes the
//! container's limits, so a container is never left half-updated. QEMU
//! lives in the pod's cgroup: a VM holding more than the pod's new total
//! would fail kubelet's pod limit (EBUSY on cgroup v1) or be OOM-killed
//! (v2), hence the refusal instead.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crust_agent_proto::{ClientError, CpuMax, ErrorCode, OnlineCpus, UpdateContainer};

use crate::shim::{Code, agent_code};
use crate::spec::{Limits, MEMORY_FIELD};
use crate::vm::PodVm;

/// Hot-plugged memory comes in 128 MiB blocks on x86-64.
const BLOCK_MIB: u32 = 128;
/// Kept free in the guest when it gives memory back.
const GIVE_BACK_MARGIN_MIB: u64 = 32;
/// How long the guest gets to inflate the balloon / online vCPUs.
const SETTLE: Duration = Duration::from_secs(15);
/// Close enough to the balloon's target.
const BALLOON_SLACK_MIB: u64 = 4;

/// The node's bounds on a pod VM's memory (its door's settings).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// What the guest itself needs besides its containers.
    pub overhead_mib: u32,
    pub max_memory_mib: u32,
}

/// The pod VM's size and what its containers ask of it.
#[derive(Debug, Default)]
pub struct Sizing {
    /// Guest RAM plugged: boot memory plus DIMMs.
    pub plugged_mib: u32,
    pub dimms: u32,
    /// What the guest keeps: plugged less the balloon.
    pub held_mib: u32,
    pub pod_limit: u64,
    pub memory: HashMap<String, u64>,
    pub vcpus: u32,
    pub max_vcpus: u32,
    pub cpu: HashMap<String, CpuMax>,
}

impl Sizing {
    pub fn booted(memory_mib: u32, vcpus: u32, max_vcpus: u32) -> Sizing {
        Sizing {
            plugged_mib: memory_mib,
            held_mib: memory_mib,
            vcpus,
            max_vcpus: max_vcpus.max(vcpus),
            ..Default::default()
        }
    }

    /// Guest memory the pod needs: the overhead plus the larger of the
    /// pod's own limit and its containers' limits.
    pub fn needed_mib(&self, memory: &HashMap<String, u64>, overhead_mib: u32) -> u32 {
        let wanted = memory.values().sum::<u64>().max(self.pod_limit);
        (wanted.div_ceil(1 << 20) as u32).saturating_add(overhead_mib)
    }

    /// vCPUs the pod's quotas add up to, within the VM's slots.
    fn needed_vcpus(&self, cpu: &HashMap<String, CpuMax>) -> u32 {
        // In millionths of a CPU: integers, no rounding drift.
        let micro: u64 = cpu
            .values()
            .filter_map(|c| {
                Some(
                    c.quota_us?
                        .saturating_mul(1_000_000)
                        .div_ceil(c.period_us.max(1)),
                )
            })
            .fold(0, u64::saturating_add);
        (micro.div_ceil(1_000_000).min(u64::from(u32::MAX)) as u32)
            .clamp(self.vcpus, self.max_vcpus.max(self.vcpus))
    }
}

/// How the VM's memory changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryStep {
    /// The balloon gives the guest back memory it holds already.
    Deflate { target_mib: u32 },
    /// DIMMs are added (the balloon fully deflated first).
    HotAdd { add_mib: u32 },
    /// The balloon takes memory from the guest.
    Inflate { target_mib: u32 },
}

/// What one Update does, decided before anything changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub memory: Option<MemoryStep>,
    /// vCPUs to have present (more than now).
    pub vcpus: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    #[error(
        "{MEMORY_FIELD}: the pod would need {needed} MiB of guest memory; the VM has {plugged} MiB and can grow to {max} MiB (maxmem, {slots} DIMM slots left): nothing changed"
    )]
    AboveMaxMemory {
        needed: u32,
        plugged: u32,
        max: u32,
        slots: u32,
    },
    #[error(
        "{MEMORY_FIELD}: the pod's VM holds {held} MiB and would have to shrink to {needed} MiB, but its guest can give back only {can} MiB now (QEMU runs in the pod's cgroup: a pod limit below what the VM holds fails or OOM-kills it): nothing changed"
    )]
    CannotGiveBack { held: u32, needed: u32, can: u64 },
    #[error(
        "{MEMORY_FIELD}: the guest gave back memory down to {actual} MiB only, {target} MiB asked, in {SETTLE:?}: the container's limits were put back"
    )]
    BalloonStuck { target: u32, actual: u64 },
    /// The guest refused the container's new limit (it holds more).
    #[error("{MEMORY_FIELD}: {0}")]
    HeldByContainer(String),
    #[error("{what}: {reason}")]
    Vm { what: &'static str, reason: String },
    #[error("guest agent: {0}")]
    Agent(#[from] ClientError),
}

impl ResizeError {
    pub fn code(&self) -> Code {
        match self {
            ResizeError::AboveMaxMemory { .. } => Code::OutOfRange,
            ResizeError::CannotGiveBack { .. } | ResizeError::HeldByContainer(_) => {
                Code::FailedPrecondition
            }
            ResizeError::BalloonStuck { .. } | ResizeError::Vm { .. } => Code::Internal,
            ResizeError::Agent(e) => agent_code(e),
        }
    }
}

/// Decides how the VM changes for container `cid` to get `new`, given
/// what the guest can give back now (`available_mib`).
pub fn plan(
    s: &Sizing,
    cid: &str,
    new: Limits,
    overhead_mib: u32,
    max_memory_mib: u32,
    available_mib: u64,
) -> Result<Plan, ResizeError> {
    let mut memory = s.memory.clone();
    if let Some(m) = new.memory {
        memory.insert(cid.to_string(), m);
    }
    let mut cpu = s.cpu.clone();
    if let Some(c) = new.cpu {
        cpu.insert(cid.to_string(), c);
    }
    let needed = s.needed_mib(&memory, overhead_mib);
    // CRI sends every limit in each Update: only a lower memory limit
    // shrinks the VM (a CPU change never does).
    let lowered = new
        .memory
        .is_some_and(|m| s.memory.get(cid).is_none_or(|old| m < *old));
    let step = if needed > s.held_mib {
        Some(grow_step(s, needed, max_memory_mib)?)
    } else if needed < s.held_mib && lowered {
        let can = available_mib.saturating_sub(GIVE_BACK_MARGIN_MIB);
        if u64::from(s.held_mib - needed) > can {
            return Err(ResizeError::CannotGiveBack {
                held: s.held_mib,
                needed,
                can,
            });
        }
        Some(MemoryStep::Inflate { target_mib: needed })
    } else {
        None
    };
    let vcpus = s.needed_vcpus(&cpu);
    Ok(Plan {
        memory: step,
        vcpus: (vcpus > s.vcpus).then_some(vcpus),
    })
}

/// How to grow the guest to `needed` MiB: the balloon first, DIMMs after.
pub fn grow_step(s: &Sizing, needed: u32, max_memory_mib: u32) -> Result<MemoryStep, ResizeError> {
    if needed <= s.plugged_mib {
        return Ok(MemoryStep::Deflate { target_mib: needed });
    }
    let add = (needed - s.plugged_mib).div_ceil(BLOCK_MIB) * BLOCK_MIB;
    if s.dimms >= crust_vmm::MEMORY_SLOTS || s.plugged_mib + add > max_memory_mib {
        return Err(ResizeError::AboveMaxMemory {
            needed,
            plugged: s.plugged_mib,
            max: max_memory_mib,
            slots: crust_vmm::MEMORY_SLOTS.saturating_sub(s.dimms),
        });
    }
    Ok(MemoryStep::HotAdd { add_mib: add })
}

fn vm_err(what: &'static str) -> impl FnOnce(crust_qmp::QmpError) -> ResizeError {
    move |e| ResizeError::Vm {
        what,
        reason: e.to_string(),
    }
}

/// Applies a growth step; the bookkeeping follows what happened.
pub async fn grow(vm: &PodVm, s: &mut Sizing, step: MemoryStep) -> Result<(), ResizeError> {
    match step {
        MemoryStep::Deflate { target_mib } => {
            vm.qmp
                .balloon_target(u64::from(target_mib) << 20)
                .await
                .map_err(vm_err("deflating the balloon"))?;
            s.held_mib = target_mib;
        }
        MemoryStep::HotAdd { add_mib } => {
            if s.held_mib < s.plugged_mib {
                vm.qmp
                    .balloon_target(u64::from(s.plugged_mib) << 20)
                    .await
                    .map_err(vm_err("deflating the balloon"))?;
                s.held_mib = s.plugged_mib;
            }
            let n = s.dimms;
            let mem_id = format!("crust-dimm-mem{n}");
            vm.qmp
                .execute(
                    "object-add",
                    serde_json::json!({
                        "qom-type": "memory-backend-memfd",
                        "id": mem_id,
                        "size": u64::from(add_mib) << 20,
                        // Shared with virtiofsd, as the boot memory.
                        "share": true,
                    }),
                )
                .await
                .map_err(vm_err("adding guest memory"))?;
            if let Err(e) = vm
                .qmp
                .execute(
                    "device_add",
                    serde_json::json!({"driver": "pc-dimm", "id": format!("crust-dimm{n}"), "memdev": mem_id}),
                )
                .await
            {
                let _ = vm
                    .qmp
                    .execute("object-del", serde_json::json!({"id": mem_id}))
                    .await;
                return Err(vm_err("plugging a memory DIMM")(e));
            }
            s.dimms += 1;
            s.plugged_mib += add_mib;
            s.held_mib = s.plugged_mib;
        }
        MemoryStep::Inflate { .. } => unreachable!("grow is never asked to shrink"),
    }
    Ok(())
}

/// Inflates the balloon to `target_mib` and waits for the guest to get
/// there; on failure asks for the old size back.
async fn shrink(vm: &PodVm, s: &mut Sizing, target_mib: u32) -> Result<(), ResizeError> {
    let target = u64::from(target_mib) << 20;
    vm.qmp
        .balloon_target(target)
        .await
        .map_err(vm_err("inflating the balloon"))?;
    let until = Instant::now() + SETTLE;
    loop {
        let actual = vm
            .qmp
            .balloon_actual()
            .await
            .map_err(vm_err("query-balloon"))?;
        if actual <= target + (BALLOON_SLACK_MIB << 20) {
            s.held_mib = target_mib;
            return Ok(());
        }
        if Instant::now() >= until {
            let _ = vm.qmp.balloon_target(u64::from(s.held_mib) << 20).await;
            return Err(ResizeError::BalloonStuck {
                target: target_mib,
                actual: actual >> 20,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Gives container `cid` of pod `pod_id` the limits `new`: plans against
/// the bookkeeping `s` and the guest's figures, grows the VM (memory,
/// vCPUs), sets the container's cgroup, then shrinks the VM; undoes the
/// container's limits when the shrink fails.
pub async fn apply(
    vm: &PodVm,
    s: &mut Sizing,
    cid: &str,
    new: Limits,
    bounds: Bounds,
    pod_id: &str,
) -> Result<(), ResizeError> {
    let info = vm.agent.call(crust_agent_proto::GuestInfo {}).await?;
    let plan = plan(
        s,
        cid,
        new,
        bounds.overhead_mib,
        bounds.max_memory_mib,
        info.mem_available_bytes >> 20,
    )?;
    let old = Limits {
        memory: s.memory.get(cid).copied(),
        cpu: s.cpu.get(cid).copied(),
    };
    if let Some(step @ (MemoryStep::Deflate { .. } | MemoryStep::HotAdd { .. })) = plan.memory {
        grow(vm, s, step).await?;
    }
    if let Some(n) = plan.vcpus {
        let present = vm
            .qmp
            .plug_vcpus(n)
            .await
            .map_err(vm_err("hot-plugging vCPUs"))?;
        s.vcpus = present;
        let on = vm
            .agent
            .call_with_timeout(
                OnlineCpus {
                    want: present,
                    timeout_ms: SETTLE.as_millis() as u64,
                },
                SETTLE + Duration::from_secs(5),
            )
            .await?;
        if on.online < present {
            tracing::warn!(
                "pod {}: {} of {present} vCPUs online in the guest",
                pod_id,
                on.online
            );
        }
    }
    vm.agent
        .call(UpdateContainer {
            id: cid.to_string(),
            memory_limit_bytes: new.memory,
            cpu_max: new.cpu,
        })
        .await
        .map_err(|e| match e {
            ClientError::Agent(a) if a.code == ErrorCode::FailedPrecondition => {
                ResizeError::HeldByContainer(a.message)
            }
            e => ResizeError::Agent(e),
        })?;
    if let Some(MemoryStep::Inflate { target_mib }) = plan.memory
        && let Err(e) = shrink(vm, s, target_mib).await
    {
        let back = UpdateContainer {
            id: cid.to_string(),
            // Unlimited before: the largest value memory.max takes.
            memory_limit_bytes: new.memory.map(|_| old.memory.unwrap_or(i64::MAX as u64)),
            cpu_max: new.cpu.map(|_| {
                old.cpu.unwrap_or(CpuMax {
                    quota_us: None,
                    period_us: 100_000,
                })
            }),
        };
        if let Err(u) = vm.agent.call(back).await {
            tracing::error!("container {cid}: putting its limits back: {u}");
        }
        return Err(e);
    }
    if let Some(m) = new.memory {
        s.memory.insert(cid.to_string(), m);
    }
    if let Some(c) = new.cpu {
        s.cpu.insert(cid.to_string(), c);
    }
    tracing::info!(
        "pod {}: container {cid} resized to {new:?}; guest memory {} of {} MiB plugged, {} vCPUs",
        pod_id,
        s.held_mib,
        s.plugged_mib,
        s.vcpus
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizing() -> Sizing {
        let mut s = Sizing::booted(512, 1, 2);
        s.memory.insert("c".into(), 256 << 20);
        s
    }

    fn mem(m: u64) -> Limits {
        Limits {
            memory: Some(m << 20),
            cpu: None,
        }
    }

    #[test]
    fn memory_up_hot_adds_whole_blocks_within_maxmem() {
        let s = sizing();
        let p = plan(&s, "c", mem(512), 160, 8192, 0).unwrap();
        assert_eq!(p.memory, Some(MemoryStep::HotAdd { add_mib: 256 }));
        let e = plan(&s, "c", mem(8192), 160, 8192, 0).unwrap_err();
        assert!(matches!(
            e,
            ResizeError::AboveMaxMemory { needed: 8352, .. }
        ));
        assert!(e.to_string().starts_with(MEMORY_FIELD), "{e}");
    }

    #[test]
    fn memory_down_only_as_far_as_the_guest_gives_back() {
        let mut s = sizing();
        s.memory.insert("c".into(), 512 << 20);
        s.plugged_mib = 768;
        s.held_mib = 768;
        let p = plan(&s, "c", mem(384), 160, 8192, 400).unwrap();
        assert_eq!(p.memory, Some(MemoryStep::Inflate { target_mib: 544 }));
        let e = plan(&s, "c", mem(384), 160, 8192, 100).unwrap_err();
        assert!(
            matches!(
                e,
                ResizeError::CannotGiveBack {
                    held: 768,
                    needed: 544,
                    can: 68
                }
            ),
            "{e}"
        );
        // The same limit again (CRI sends all of them) changes nothing.
        assert_eq!(plan(&s, "c", mem(512), 160, 8192, 0).unwrap().memory, None);
        // Held memory back under the plugged size: the balloon deflates.
        s.memory.insert("c".into(), 384 << 20);
        s.held_mib = 544;
        let p = plan(&s, "c", mem(512), 160, 8192, 0).unwrap();
        assert_eq!(p.memory, Some(MemoryStep::Deflate { target_mib: 672 }));
    }

    #[test]
    fn vcpus_follow_the_quotas_up_to_the_slots() {
        let s = sizing();
        let cpu = |q| Limits {
            memory: None,
            cpu: Some(CpuMax {
                quota_us: Some(q),
                period_us: 100_000,
            }),
        };
        assert_eq!(
            plan(&s, "c", cpu(100_000), 160, 8192, 0).unwrap().vcpus,
            None
        );
        assert_eq!(
            plan(&s, "c", cpu(150_000), 160, 8192, 0).unwrap().vcpus,
            Some(2)
        );
        assert_eq!(
            plan(&s, "c", cpu(800_000), 160, 8192, 0).unwrap().vcpus,
            Some(2)
        );
    }
}
