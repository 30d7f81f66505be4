//! tcpdump on a host interface, for tests that must see what crosses a
//! link (anti-spoofing: what a guest's frames look like on the bridge).

use std::io::{BufRead, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running capture, from tcpdump's "listening on" to [`Capture::stop`];
/// killed on drop.
pub struct Capture(Child);

impl Capture {
    /// `tcpdump -n -e` (link headers too) on `dev`, once it listens.
    pub fn start(dev: &str) -> Capture {
        let mut c = Command::new("tcpdump")
            .args(["-n", "-e", "-l", "-U", "-i", dev])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tcpdump (scripts/install-deps.sh installs it)");
        let mut err = std::io::BufReader::new(c.stderr.take().expect("stderr"));
        let mut line = String::new();
        while !line.contains("listening on") {
            line.clear();
            assert!(
                err.read_line(&mut line).expect("tcpdump's stderr") > 0,
                "tcpdump ended"
            );
        }
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        Capture(c)
    }

    /// What was seen, one line per frame, after half a second more.
    pub fn stop(mut self) -> String {
        std::thread::sleep(Duration::from_millis(500));
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        let mut out = String::new();
        if let Some(o) = self.0.stdout.as_mut() {
            let _ = o.read_to_string(&mut out);
        }
        let _ = self.0.wait();
        out
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
