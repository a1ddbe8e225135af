//! `gpuverbs doctor`: what gpuverbs will do on this machine, and why.
//!
//! The doctor gathers facts ([`sysfs`] and /proc, the CUDA driver in [`cuda`], rdma-core in
//! [`rdma`], NVML in [`nvml`], the host API's own device selection) and turns them into
//! [`Check`]s in [`checks`]. Every probe that fails becomes a check that says so; nothing here
//! panics or aborts the run. The exit status is the worst check's ([`Status::exit_code`]).
//!
//! A machine without a GPU is not broken: the soft NIC and the CPU initiator run there. So a
//! missing CUDA driver or GPU is "not applicable" (no GPU anywhere) or a warning (a GPU the
//! driver cannot use), unless [`Options::gpu`] says a GPU is wanted; then it is a failure.

pub mod checks;
pub mod cuda;
pub mod nvml;
pub mod rdma;
pub mod sysfs;

use serde::Serialize;
use std::fmt;

/// The outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Nothing to check here (the thing is absent, or another check already failed); the
    /// detail says why.
    NotApplicable,
    /// Fine.
    Ok,
    /// Works, but not as well as it could, or could not be verified.
    Warn,
    /// Broken: the path gpuverbs needs does not work.
    Fail,
}

impl Status {
    /// The doctor's exit status when this is the worst check: 0 for ok and not applicable,
    /// 1 for warn, 3 for fail (2 stays the code of a gpuverbs command that could not run).
    pub fn exit_code(self) -> u8 {
        match self {
            Self::NotApplicable | Self::Ok => 0,
            Self::Warn => 1,
            Self::Fail => 3,
        }
    }

    /// The label printed in the text report.
    pub fn label(self) -> &'static str {
        match self {
            Self::NotApplicable => "n/a",
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One check: a name, its outcome and the evidence it read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Dotted name, e.g. `cuda.driver`, `gpu0.dma_buf`, `rdma.mlx5_0`.
    pub name: String,
    /// Outcome.
    pub status: Status,
    /// What was read and what it means.
    pub detail: String,
}

impl Check {
    /// A check.
    pub fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            status,
            detail: detail.into(),
        }
    }
}

/// What the user asked the doctor to hold the machine to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// `--gpu`: the user means to use a GPU, so a missing CUDA driver or GPU is a failure
    /// (without it, a machine with no GPU is checked for what runs there: the soft NIC or an
    /// rdma-core device, with the CPU initiator).
    pub gpu: bool,
}

/// Every check of one run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// In the order they ran.
    pub checks: Vec<Check>,
    /// One sentence: what runs on this machine (the device gpuverbs picks, and who posts: GPU
    /// kernels or only the CPU initiator). Empty when nothing could be opened.
    pub runs_here: String,
}

impl Report {
    /// The worst status (`NotApplicable` for an empty report).
    pub fn worst(&self) -> Status {
        self.checks
            .iter()
            .map(|c| c.status)
            .max()
            .unwrap_or(Status::NotApplicable)
    }

    /// The exit status of the run.
    pub fn exit_code(&self) -> u8 {
        self.worst().exit_code()
    }

    /// `{"checks": [{"name", "status", "detail"}, ...], "runs_here": "..."}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| {
            // Serializing plain strings cannot fail; say so in the output's own shape if it did.
            format!(
                "{{\"checks\": [{{\"name\": \"doctor\", \"status\": \"fail\", \"detail\": {:?}}}]}}",
                e.to_string()
            )
        })
    }

    /// One block per check: `[status] name: detail`.
    pub fn to_text(&self) -> String {
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut s = String::new();
        for c in &self.checks {
            s.push_str(&format!(
                "[{:>4}] {:width$}  {}\n",
                c.status.label(),
                c.name,
                c.detail
            ));
        }
        let worst = self.worst();
        let count = |st: Status| self.checks.iter().filter(|c| c.status == st).count();
        if !self.runs_here.is_empty() {
            s.push_str(&format!("\nWhat runs here: {}\n", self.runs_here));
        }
        s.push_str(&format!(
            "\n{} checks: {} ok, {} warn, {} fail, {} not applicable; exit status {}\n",
            self.checks.len(),
            count(Status::Ok),
            count(Status::Warn),
            count(Status::Fail),
            count(Status::NotApplicable),
            worst.exit_code()
        ));
        s
    }
}

/// Runs every check on this machine.
pub fn run(opts: Options) -> Report {
    checks::run(&sysfs::Sys::host(), opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_and_exit_codes() {
        let mut r = Report::default();
        assert_eq!(r.exit_code(), 0);
        r.checks.push(Check::new("a", Status::NotApplicable, "x"));
        r.checks.push(Check::new("b", Status::Ok, "y"));
        assert_eq!((r.worst(), r.exit_code()), (Status::Ok, 0));
        r.checks.push(Check::new("c", Status::Warn, "z"));
        assert_eq!(r.exit_code(), 1);
        r.checks.push(Check::new("d", Status::Fail, "w"));
        r.checks.push(Check::new("e", Status::Ok, "v"));
        assert_eq!((r.worst(), r.exit_code()), (Status::Fail, 3));
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        let checks = v["checks"].as_array().unwrap();
        assert_eq!(checks.len(), 5);
        assert_eq!(checks[0]["status"], "not_applicable");
        assert_eq!(checks[3]["status"], "fail");
        assert_eq!(checks[2]["name"], "c");
        let text = r.to_text();
        assert!(text.contains("[FAIL] d"), "{text}");
        assert!(text.contains("exit status 3"), "{text}");
    }
}
