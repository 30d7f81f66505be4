//! Threads for work that may block on a hung device (health probes,
//! statvfs). A job goes to a thread that waits idle, or to a new thread
//! when none waits, so a probe stuck in the kernel holds up nothing else.
//! Starting a thread per probe was most of an uncached
//! NodeGetVolumeStats; a few idle threads are kept instead.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

type Job = Box<dyn FnOnce() + Send>;

/// Idle threads kept; a thread finding this many idle ends.
const MAX_IDLE: usize = 4;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Threads waiting for a job and not yet promised one.
    idle: usize,
}

#[derive(Default)]
pub(crate) struct Workers {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Workers {
    pub(crate) fn new() -> Arc<Workers> {
        Arc::default()
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `job` on an idle thread, or on a new one named `name`.
    pub(crate) fn run(
        self: &Arc<Self>,
        name: &str,
        job: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<()> {
        let job: Job = Box::new(job);
        {
            let mut q = self.lock();
            if q.idle > 0 {
                // Each queued job has an idle thread promised to it.
                q.idle -= 1;
                q.jobs.push_back(job);
                self.ready.notify_one();
                return Ok(());
            }
        }
        let me = self.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                job();
                me.serve();
            })
            .map(drop)
    }

    /// Waits for jobs while fewer than [`MAX_IDLE`] threads wait.
    fn serve(&self) {
        loop {
            let job = {
                let mut q = self.lock();
                if q.idle >= MAX_IDLE {
                    return;
                }
                q.idle += 1;
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break j;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            job();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    fn thread_id(w: &Arc<Workers>) -> std::thread::ThreadId {
        let (tx, rx) = mpsc::channel();
        w.run("t", move || tx.send(std::thread::current().id()).unwrap())
            .unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn an_idle_thread_is_reused() {
        let w = Workers::new();
        let first = thread_id(&w);
        // Let the thread go idle.
        for _ in 0..100 {
            if w.lock().idle == 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(thread_id(&w), first);
    }

    #[test]
    fn a_stuck_job_holds_up_no_other() {
        let w = Workers::new();
        let (release, stuck) = mpsc::channel::<()>();
        w.run("stuck", move || {
            let _ = stuck.recv();
        })
        .unwrap();
        // The stuck thread is busy: the next jobs still run, on other threads.
        let (tx, rx) = mpsc::channel();
        for i in 0..8 {
            let tx = tx.clone();
            w.run("t", move || tx.send(i).unwrap()).unwrap();
        }
        let mut got: Vec<i32> = (0..8)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        got.sort();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
        release.send(()).unwrap();
        // At most MAX_IDLE threads stay.
        std::thread::sleep(Duration::from_millis(100));
        assert!(w.lock().idle <= MAX_IDLE);
    }
}
