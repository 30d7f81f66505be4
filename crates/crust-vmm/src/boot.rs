//! Launching and booting a VM under the accelerator [`crate::accel`]
//! chooses, with the fallback from a KVM boot that hangs to TCG.

use std::time::Duration;

use crate::VmError;
use crate::accel::{self, AccelChoice, ResolvedAccel};
use crate::config::{Accel, VmConfig};
use crate::vm::{Vm, boot_context, wait_agent};

impl Vm {
    /// Starts QEMU for `cfg` and waits until its QMP monitor answers a
    /// command (the machine is built, sockets exist) — not for the guest to boot: use
    /// the agent client's `wait_ready` for that.
    ///
    /// Fails with [`VmError::AlreadyRunning`] if a live QEMU already owns
    /// `run_dir`, and with [`VmError::EarlyExit`] (carrying the tail of
    /// `qemu.log`) if QEMU dies while starting.
    pub async fn launch(cfg: VmConfig) -> Result<Vm, VmError> {
        cfg.validate()?;
        let choice = accel::choose(&cfg).await?;
        Vm::launch_with(cfg, choice).await
    }

    /// Launches the guest and waits until its agent answers a ping. With
    /// `Accel::Auto`, a KVM boot that does not reach the agent within
    /// `cfg.kvm_boot_timeout` is killed, recorded (later boots on this
    /// host boot use TCG) and booted again under TCG with the full
    /// `ready_timeout`; the VM's [`Vm::accel_choice`] tells what happened.
    pub async fn boot(cfg: VmConfig, ready_timeout: Duration) -> Result<Vm, VmError> {
        cfg.validate()?;
        let choice = accel::choose(&cfg).await?;
        let auto_kvm = cfg.accel == Accel::Auto && choice.accel == ResolvedAccel::Kvm;
        let first_wait = if auto_kvm {
            cfg.kvm_boot_timeout.min(ready_timeout)
        } else {
            ready_timeout
        };
        let mut vm = Vm::launch_with(cfg.clone(), choice.clone()).await?;
        let why = match wait_agent(&mut vm, first_wait).await {
            Ok(()) => return Ok(vm),
            Err(why) => why,
        };
        let context = boot_context(vm.paths());
        if !auto_kvm {
            let e = VmError::NotReady {
                after: first_wait,
                accel: choice.accel.as_str(),
                reason: why,
                context: vm.failure_context(),
            };
            let _ = vm.kill();
            if cfg.accel == Accel::Auto {
                // Not even TCG boots it: a negative KVM verdict built on
                // this image proves nothing.
                accel::forget_failure(&cfg).await;
            }
            return Err(e);
        }
        let reason = format!(
            "a KVM boot did not reach the guest agent within {first_wait:?} ({why}{}); booted again under TCG",
            context.map(|c| format!("; {c}")).unwrap_or_default()
        );
        tracing::warn!(vm = %cfg.name, "{reason}");
        vm.kill()?;
        drop(vm);
        accel::record_failure(&cfg, &reason).await;
        let tcg = AccelChoice {
            accel: ResolvedAccel::Tcg,
            reason,
            fallback: true,
        };
        let mut vm = Vm::launch_with(cfg, tcg).await?;
        match wait_agent(&mut vm, ready_timeout).await {
            Ok(()) => Ok(vm),
            Err(why) => {
                let e = VmError::NotReady {
                    after: ready_timeout,
                    accel: "tcg",
                    reason: why,
                    context: vm.failure_context(),
                };
                let _ = vm.kill();
                Err(e)
            }
        }
    }
}
