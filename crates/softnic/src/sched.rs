//! How the device's own threads (engine, wire I/O) ask the scheduler to be as prompt as a NIC.
//!
//! A ConnectX has its own processors; the soft NIC borrows the host's. Where a program polls its
//! completions in memory on every core (UCX's `rc_mlx5`, mlx5dv users, a GPU proxy thread), a
//! device thread that wakes (a timer, a datagram) has to take a core from that poller, and
//! Linux's fair scheduler (EEVDF) lets the running task finish its slice first: about a
//! millisecond per wake-up, per hop. A thread may ask for a shorter slice of its own
//! (`sched_setattr` with `SCHED_OTHER` and a `sched_runtime`, Linux 6.12 and later, no
//! privilege needed); a task with a shorter slice preempts a longer one when it wakes. Its share
//! of the CPU does not change (same policy, same nice): only how soon it runs after it wakes.
//!
//! The short slice is asked for only while no thread of the program carries the device (see
//! [`DeviceThread::set_prompt`]). Where the kernel refuses (older than 6.12, a seccomp
//! filter), nothing else changes: the device then waits for the poller's slice as before.
//!
//! A short slice helps only a thread that sleeps: one that spins and yields stays runnable, and
//! a runnable thread waits for the other task's slice to end. So a device thread learns, from
//! how long its own `sched_yield` took, whether its core is shared with a busy task
//! ([`Spinner`]), and while it is, it sleeps instead of spinning (its wake-ups then preempt).
//! The wire I/O thread also watches for the doorbell that answers what it delivers
//! ([`AnswerWatch`]), and leaves the core of a poller beside which its watch cannot pay
//! ([`CoreDodge`]).

use std::time::{Duration, Instant};

/// The slice the device's threads ask for: the shortest the kernel accepts (100 µs).
pub const DEVICE_SLICE: Duration = Duration::from_micros(100);

/// A `sched_yield` that returns later than this gave the core to another task's slice.
const CONTENDED_YIELD: Duration = Duration::from_micros(100);
/// How long a device thread that found its core shared sleeps instead of spinning, at first;
/// found shared again within that long after, twice as long, up to [`CONTENDED_MAX`]. One
/// slow yield may be a passing task (a short wait costs little); a busy poller is found again
/// and again (spinning beside it costs its slice every time).
const CONTENDED_MIN: Duration = Duration::from_millis(20);
const CONTENDED_MAX: Duration = Duration::from_millis(640);

/// A device thread's spin, told by its own yields whether spinning pays.
#[derive(Debug)]
pub struct Spinner {
    contended_until: Option<Instant>,
    penalty: Duration,
}

impl Default for Spinner {
    fn default() -> Self {
        Self {
            contended_until: None,
            penalty: CONTENDED_MIN,
        }
    }
}

impl Spinner {
    /// Gives the core away once (`sched_yield`), timing how long it took to come back.
    pub fn yield_now(&mut self) {
        let start = Instant::now();
        std::thread::yield_now();
        let now = Instant::now();
        if now.duration_since(start) > CONTENDED_YIELD {
            self.found_shared(now);
        }
    }

    /// A yield that ended at `now` found the core shared: no spinning for a while.
    fn found_shared(&mut self, now: Instant) {
        self.penalty = match self.contended_until {
            Some(until) if now < until + self.penalty => (self.penalty * 2).min(CONTENDED_MAX),
            _ => CONTENDED_MIN,
        };
        self.contended_until = Some(now + self.penalty);
    }

    /// Whether spinning pays at `now`: no recent yield found the core shared.
    pub fn may_spin(&self, now: Instant) -> bool {
        self.contended_until.is_none_or(|until| now >= until)
    }
}

/// The first look for an answer's doorbell after a datagram its program may answer, at
/// first: about a poller's time to see the CQE and ring (the wake-up comes a few
/// microseconds later still). It then follows when the answers come: earlier while the first
/// look finds them, later while only later looks do, within [`FIRST_MIN`]..[`FIRST_MAX`].
const ANSWER_FIRST: Duration = Duration::from_micros(4);
const FIRST_MIN: Duration = Duration::from_micros(2);
const FIRST_MAX: Duration = Duration::from_micros(64);
/// The last look: each one after the first waits twice as long as the one before (from 4 µs:
/// 4, 8, …, 128 µs after the datagram, six looks, 252 µs in all).
const ANSWER_LAST: Duration = Duration::from_micros(128);
/// How long the I/O thread stays awake after a delivery, running the engine's turns, for the
/// answer: worth it when the program's poller runs on another core (it answers within this
/// and the thread's sleep and wake-up are saved), not when the two share one (the poller
/// cannot answer while the thread spins). So it stays again only while stays pay, and tries
/// once in [`STAY_RETRY`] deliveries otherwise.
const ANSWER_STAY: Duration = Duration::from_micros(40);
const STAY_RETRY: u32 = 8;

/// After [`COLD_AFTER`] watches in a row found nothing (a passive peer: an RDMA READ's
/// target, a bandwidth test's receiver), the next ones are skipped: one more for each further
/// fruitless watch, up to [`COLD_SKIP_MAX`]; one that finds its doorbell starts over. (A
/// ping-pong's stray fruitless watch, for a datagram nobody answers, skips nothing.)
const COLD_AFTER: u32 = 4;
const COLD_SKIP_MAX: u32 = 64;

/// The wire I/O thread's watch for the doorbell that answers a datagram it just delivered.
///
/// A program that polls its CQs in memory (UCX's `rc_mlx5`, mlx5dv users) rings its doorbells
/// in memory too, unseen until a device thread looks, and on a machine whose cores it keeps
/// busy every look is a wake-up that takes a core from it. Most of its doorbells answer a
/// message (a ping-pong's reply, the next request after a response), so they come a few
/// microseconds after the I/O thread delivered one: that thread, awake already, looks then
/// (and again at growing intervals for a while) instead of the engine looking blindly every
/// few tens of microseconds. What it runs is the engine's turn ([`crate::Device::progress`]
/// without the receive): the device sees the doorbell sooner, never anything it would not
/// have seen.
#[derive(Debug)]
pub struct AnswerWatch {
    /// When to look next, while watching.
    at: Option<Instant>,
    /// The wait before the look at `at`.
    step: Duration,
    /// Watches in a row that found nothing.
    fruitless: u32,
    /// Deliveries still to pass over before the next watch (a passive peer).
    skip: u32,
    /// Whether the current watch has found nothing yet.
    pending: bool,
    /// The wait before the first look (learnt: [`ANSWER_FIRST`]).
    first: Duration,
    /// When the current watch began, and when it last looked.
    armed_at: Instant,
    last_look: Instant,
    /// Whether the last stay found the answer, and the deliveries since it did not.
    stay_paid: bool,
    unstayed: u32,
}

impl Default for AnswerWatch {
    fn default() -> Self {
        Self {
            at: None,
            step: ANSWER_FIRST,
            fruitless: 0,
            skip: 0,
            pending: false,
            first: ANSWER_FIRST,
            armed_at: Instant::now(),
            last_look: Instant::now(),
            stay_paid: true,
            unstayed: 0,
        }
    }
}

impl AnswerWatch {
    /// A datagram the program may answer was delivered at `now`: watch for the answer's
    /// doorbell (unless recent watches found none: then only now and then).
    pub fn arm(&mut self, now: Instant) {
        if self.at.is_none() {
            if self.skip > 0 {
                self.skip -= 1;
                return;
            }
            self.pending = true;
        }
        // (still watching for an earlier one: start over from the first look)
        self.at = Some(now + self.first);
        self.step = self.first;
        self.armed_at = now;
        self.last_look = now;
    }

    /// Right after [`AnswerWatch::arm`]: how long to stay awake for the answer, if at all
    /// (while watching, and while stays pay or once in [`STAY_RETRY`] deliveries).
    pub fn stay(&mut self) -> Option<Duration> {
        self.at?;
        self.unstayed = self.unstayed.wrapping_add(1);
        (self.stay_paid || self.unstayed >= STAY_RETRY).then(|| {
            self.unstayed = 0;
            ANSWER_STAY
        })
    }

    /// Whether the last stay found the answer (the next one is expected to).
    pub fn stays_pay(&self) -> bool {
        self.stay_paid
    }

    /// A stay ended at `now`, with the answer (`found`: the watch ends) or without.
    pub fn stayed(&mut self, found: bool, now: Instant) {
        self.stay_paid = found;
        if found {
            self.looked(true, now);
        }
    }

    /// Stops watching (the program's own polls now run the device's turns).
    pub fn disarm(&mut self) {
        self.at = None;
        self.pending = false;
    }

    /// Whether a look is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.at.is_some_and(|t| now >= t)
    }

    /// Whether a watch is on.
    pub fn armed(&self) -> bool {
        self.at.is_some()
    }

    /// A look at `now` found a doorbell (`found`) or not: the watch ends, or looks again
    /// twice as late, until [`ANSWER_LAST`]. Returns whether the watch gave up (its last look
    /// found nothing: the answer, if any, comes late, and the engine must look for it).
    pub fn looked(&mut self, found: bool, now: Instant) -> bool {
        if found {
            self.learn(now);
            self.at = None;
            self.pending = false;
            self.fruitless = 0;
            self.skip = 0;
        } else if self.step >= ANSWER_LAST {
            self.at = None;
            if self.pending {
                self.pending = false;
                self.fruitless = self.fruitless.saturating_add(1);
                if self.fruitless >= COLD_AFTER {
                    self.skip = (self.fruitless - COLD_AFTER + 1).min(COLD_SKIP_MAX);
                }
            }
            return true;
        } else {
            self.step *= 2;
            self.at = Some(now + self.step);
            self.last_look = now;
        }
        false
    }

    /// A look at `now` found the answer: the first look comes earlier next time if it was this
    /// one (the answer may come sooner still), else closer to where the answer came (between
    /// the previous look and this one).
    fn learn(&mut self, now: Instant) {
        self.first = if self.last_look == self.armed_at {
            self.first - self.first / 8
        } else {
            let came = (self.last_look + now.saturating_duration_since(self.last_look) / 2)
                .saturating_duration_since(self.armed_at);
            (self.first * 3 + came) / 4
        }
        .clamp(FIRST_MIN, FIRST_MAX);
    }

    /// How long the I/O thread may wait at `now` for a datagram: `idle`, or until the next
    /// look.
    pub fn wait(&self, now: Instant, idle: Duration) -> Duration {
        self.at
            .map_or(idle, |t| t.saturating_duration_since(now).min(idle))
    }
}

/// Stays that found no answer while the look after them did, in a row, before the I/O thread
/// moves off its core ([`CoreDodge`]).
const DODGE_AFTER: u32 = 2;
/// The least time between two such moves.
const DODGE_EVERY: Duration = Duration::from_millis(20);
/// How long a move holds before the thread may use every CPU it started with again (the
/// poller may have moved, the core may have become busy with something else).
const DODGE_HOLD: Duration = Duration::from_secs(1);

/// Keeps the wire I/O thread off the core of the program's poller.
///
/// When the thread that delivered a datagram and the program thread that answers it (a poller
/// spinning on its CQ in memory) share a core, the thread's stay for the answer cannot pay: the
/// poller runs only once the thread sleeps. Every answer then costs a sleep and a wake-up on
/// the poller's core. A stay that finds nothing, followed by a look that finds the answer,
/// says so; twice in a row, and if a thread of the program spins on that core
/// ([`busy_thread_on`]), the thread leaves it (`sched_setaffinity`: the CPUs it started with
/// less that one), for one where its stays pay: with two ping-pong processes on two cores, the
/// core of the peer's poller, which only waits meanwhile. Measured on the 2-core
/// VM (UCX `tag_lat` over `rc_mlx5`, threads pinned by hand): about 55 µs with each process's
/// device threads on the other process's poller's core, about 100 µs on their own. A move
/// holds for [`DODGE_HOLD`]; then the thread has all its CPUs back and finds out again.
#[derive(Debug)]
pub struct CoreDodge {
    /// The CPUs the thread may use (its affinity when it started), when more than one.
    allowed: Option<Box<libc::cpu_set_t>>,
    /// The core the last stay ran on, while it found nothing.
    missed_on: Option<usize>,
    /// Such stays in a row whose answer the next look found.
    shared: u32,
    moved_at: Option<Instant>,
    /// Whether the thread runs on fewer CPUs than `allowed` now.
    moved: bool,
}

impl CoreDodge {
    /// Reads the calling thread's CPUs.
    pub fn new() -> Self {
        // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity(0, size, set) writes at
        // most `size` bytes into it for the calling thread.
        let allowed = unsafe {
            let mut set: Box<libc::cpu_set_t> = Box::new(std::mem::zeroed());
            let size = std::mem::size_of::<libc::cpu_set_t>();
            (libc::sched_getaffinity(0, size, &mut *set) == 0 && libc::CPU_COUNT(&set) >= 2)
                .then_some(set)
        };
        Self {
            allowed,
            missed_on: None,
            shared: 0,
            moved_at: None,
            moved: false,
        }
    }

    /// Gives the thread all its CPUs back once a move has held for [`DODGE_HOLD`].
    pub fn tick(&mut self, now: Instant) {
        if !self.moved || self.moved_at.is_some_and(|t| now - t < DODGE_HOLD) {
            return;
        }
        self.moved = false;
        if let Some(allowed) = self.allowed.as_deref() {
            // SAFETY: sched_setaffinity(0, size, set) reads the set (a live cpu_set_t of that
            // size) for the calling thread only.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), allowed) };
        }
    }

    /// A stay for the answer ended, having found it or not.
    pub fn stayed(&mut self, found: bool) {
        if found {
            self.shared = 0;
            self.missed_on = None;
        } else if self.allowed.is_some() {
            // SAFETY: sched_getcpu takes no arguments.
            let cpu = unsafe { libc::sched_getcpu() };
            self.missed_on = usize::try_from(cpu).ok();
        }
    }

    /// A look after the stay ended found the answer (`found`) or the watch gave up (not
    /// found). Returns whether the thread moved.
    pub fn looked(&mut self, found: bool, now: Instant) -> bool {
        let Some(cpu) = self.missed_on.take() else {
            return false;
        };
        if !found {
            self.shared = 0;
            return false;
        }
        self.shared += 1;
        if self.shared < DODGE_AFTER || self.moved_at.is_some_and(|t| now - t < DODGE_EVERY) {
            return false;
        }
        self.shared = 0;
        self.moved_at = Some(now);
        let Some(allowed) = self.allowed.as_deref() else {
            return false;
        };
        // the stays may have missed for another reason (a busy machine, a program woken by
        // completion events): move only when a thread of the program spins on that core
        if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() || !busy_thread_on(cpu) {
            return false;
        }
        let mut set = *allowed;
        // SAFETY: `cpu` is within the set (checked above), so CPU_CLR writes inside it;
        // CPU_COUNT reads it; sched_setaffinity(0, size, set) reads the set for the calling
        // thread only.
        self.moved = unsafe {
            libc::CPU_CLR(cpu, &mut set);
            libc::CPU_COUNT(&set) > 0
                && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        };
        self.moved
    }
}

/// Whether another thread of this process spins on CPU `cpu`: running or runnable (`R`), last
/// on that CPU (`/proc/self/task/*/stat`: state and processor), and preempted more often than
/// it blocked ([`spins`]).
fn busy_thread_on(cpu: usize) -> bool {
    // SAFETY: gettid takes no arguments.
    let me = unsafe { libc::gettid() }.to_string();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    tasks.flatten().any(|t| {
        if t.file_name().to_str() == Some(me.as_str()) {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            return false;
        };
        // after the name, which may hold anything: state is the first field, the processor
        // the 37th
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut f = rest.split_ascii_whitespace();
        f.next() == Some("R")
            && f.nth(35).and_then(|c| c.parse::<usize>().ok()) == Some(cpu)
            && spins(&t.path())
    })
}

/// Whether the thread whose `/proc` folder is `task` spins rather than sleeps: it was taken
/// off its core (preempted) more often than it gave the core up (blocked), as a poller that
/// reads its CQ in memory is and a program that waits for completion events is not.
fn spins(task: &std::path::Path) -> bool {
    let Ok(status) = std::fs::read_to_string(task.join("status")) else {
        return false;
    };
    let count = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    match (
        count("voluntary_ctxt_switches:"),
        count("nonvoluntary_ctxt_switches:"),
    ) {
        (Some(blocked), Some(preempted)) => preempted > blocked,
        _ => false,
    }
}

impl Default for CoreDodge {
    fn default() -> Self {
        Self::new()
    }
}

/// `struct sched_attr` as `sched_setattr(2)` takes it (`SCHED_ATTR_SIZE_VER0`, 48 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
}

/// A device thread's standing with the scheduler: its timer slack and, while it wants to be
/// prompt, its short slice.
#[derive(Debug)]
pub struct DeviceThread {
    prompt: bool,
    refused: bool,
}

impl DeviceThread {
    /// Readies the calling thread: a 1 µs timer slack (its short sleeps mean what they say),
    /// the default slice for now.
    pub fn new() -> Self {
        // SAFETY: PR_SET_TIMERSLACK takes an integer argument and touches no memory of ours.
        let _ = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        Self {
            prompt: false,
            refused: false,
        }
    }

    /// Asks for [`DEVICE_SLICE`] (`prompt`) or the default slice back, when that changes (one
    /// system call per change). A device whose program carries it (its polls run the device's
    /// turns: [`crate::Device::progress`]) wants the default: a prompt I/O thread would preempt
    /// the carrier and take the datagram that thread was about to take itself. Once the kernel
    /// refuses, it is not asked again.
    pub fn set_prompt(&mut self, prompt: bool) {
        if prompt == self.prompt || self.refused {
            return;
        }
        let slice = if prompt { DEVICE_SLICE } else { Duration::ZERO };
        if set_slice(slice) {
            self.prompt = prompt;
        } else {
            self.refused = true;
        }
    }
}

impl Default for DeviceThread {
    fn default() -> Self {
        Self::new()
    }
}

/// Sets the calling thread's slice at its current policy (`SCHED_OTHER`) and nice; zero asks
/// for the default. Returns whether the kernel took it.
fn set_slice(slice: Duration) -> bool {
    // SAFETY: getpriority reads the calling thread's nice (who 0 = the caller); it touches no
    // memory of ours. errno is cleared first since -1 is also a valid nice.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, 0);
        if n == -1 && *libc::__errno_location() != 0 {
            return false;
        }
        n
    };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        nice,
        runtime: slice.as_nanos() as u64,
        ..SchedAttr::default()
    };
    // SAFETY: sched_setattr(0, attr, 0) reads `attr` (a live, initialised sched_attr whose
    // `size` field names its length) for the calling thread and writes nothing of ours.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0u32) };
    r == 0
}

/// The calling thread's slice as the kernel reports it (`sched_getattr`'s `sched_runtime`),
/// or `None` where the kernel does not say.
pub fn slice_of_this_thread() -> Option<Duration> {
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr(0, attr, size, 0) writes at most `size` bytes into `attr`, a live
    // sched_attr of exactly that size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut SchedAttr,
            std::mem::size_of::<SchedAttr>() as u32,
            0u32,
        )
    };
    (r == 0 && attr.runtime != 0).then(|| Duration::from_nanos(attr.runtime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_device_thread_has_the_short_slice_and_gives_it_back() {
        std::thread::spawn(|| {
            let before = slice_of_this_thread();
            let mut me = DeviceThread::new();
            me.set_prompt(true);
            if me.refused {
                // a kernel without custom slices: the slice it reports (if any) is not ours
                assert_ne!(slice_of_this_thread(), Some(DEVICE_SLICE));
                return;
            }
            assert_eq!(
                slice_of_this_thread(),
                Some(DEVICE_SLICE),
                "before: {before:?}"
            );
            me.set_prompt(false);
            assert_eq!(slice_of_this_thread(), before);
            assert!(!me.refused);
        })
        .join()
        .unwrap();
    }

    /// Runs `f` on a thread pinned to the caller's current CPU.
    fn on_one_cpu<T: Send + 'static>(cpu: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(move || {
            // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it, and
            // sched_setaffinity(0, ...) reads it for the calling thread only.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                assert_eq!(
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
                    0
                );
            }
            f()
        })
        .join()
        .unwrap()
    }

    #[test]
    fn a_busy_thread_of_the_process_is_seen_on_its_core() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
        // SAFETY: sched_getcpu takes no arguments.
        let cpu = unsafe { libc::sched_getcpu() }.max(0) as usize;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let seen = std::sync::Arc::new(AtomicUsize::new(0));
        let busy = {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                on_one_cpu(cpu, move || {
                    seen.store(1, Relaxed);
                    while !stop.load(Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
        };
        while seen.load(Relaxed) == 0 {
            std::thread::yield_now();
        }
        // looked from the same CPU: each wake-up there preempts the spinner, as the device's
        // threads preempt a poller
        let found = on_one_cpu(cpu, move || {
            (0..200).any(|_| {
                std::thread::sleep(Duration::from_millis(1));
                busy_thread_on(cpu)
            })
        });
        stop.store(true, Relaxed);
        busy.join().unwrap();
        assert!(found, "no running thread seen on CPU {cpu}");
    }

    #[test]
    fn a_dodge_needs_stays_that_missed_and_looks_that_found() {
        let now = Instant::now();
        let mut d = CoreDodge::new();
        d.allowed = None; // (moves nothing here)
        assert!(!d.looked(true, now), "no stay missed");
        d.missed_on = Some(0);
        assert!(!d.looked(false, now));
        assert_eq!(d.shared, 0, "a watch that gave up says nothing");
        d.stayed(true);
        assert_eq!((d.shared, d.missed_on), (0, None));
        d.missed_on = Some(0);
        assert!(!d.looked(true, now));
        assert_eq!(d.shared, 1);
    }

    #[test]
    fn a_yield_that_lets_a_busy_task_run_its_slice_stops_the_spinning() {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        // SAFETY: sched_getcpu takes no arguments.
        let cpu = unsafe { libc::sched_getcpu() }.max(0) as usize;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let running = std::sync::Arc::new(AtomicBool::new(false));
        let busy = {
            let (stop, running) = (stop.clone(), running.clone());
            std::thread::spawn(move || {
                on_one_cpu(cpu, move || {
                    running.store(true, Relaxed);
                    while !stop.load(Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
        };
        while !running.load(Relaxed) {
            std::thread::yield_now();
        }
        // The busy thread shares the core. Whenever the scheduler holds it eligible (it has
        // not run ahead of its share), a yield hands it the core for the rest of its slice:
        // hundreds of microseconds, far beyond CONTENDED_YIELD. While it is not, a yield comes
        // back at once; the yielder's own running makes it eligible again within a slice.
        let contended = on_one_cpu(cpu, || {
            let mut s = Spinner::default();
            assert!(s.may_spin(Instant::now()));
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                s.yield_now();
                if !s.may_spin(Instant::now()) {
                    return true;
                }
            }
            false
        });
        stop.store(true, Relaxed);
        busy.join().unwrap();
        assert!(
            contended,
            "10 s of yields beside a busy thread on one core all came back at once"
        );
    }

    #[test]
    fn an_answer_watch_looks_at_growing_intervals_and_ends_at_a_find() {
        let t0 = Instant::now();
        let mut w = AnswerWatch::default();
        assert!(!w.armed() && !w.due(t0 + Duration::from_secs(1)));
        assert_eq!(
            w.wait(t0, Duration::from_millis(100)),
            Duration::from_millis(100)
        );
        w.arm(t0);
        assert!(!w.due(t0) && w.due(t0 + ANSWER_FIRST));
        assert_eq!(w.wait(t0, Duration::from_millis(100)), ANSWER_FIRST);
        // nothing at the first look: the next one twice as late
        let t1 = t0 + ANSWER_FIRST;
        assert!(!w.looked(false, t1));
        assert!(!w.due(t1 + ANSWER_FIRST) && w.due(t1 + 2 * ANSWER_FIRST));
        // found: the watch ends
        assert!(!w.looked(true, t1 + 2 * ANSWER_FIRST));
        assert!(!w.armed());
    }

    #[test]
    fn the_io_thread_stays_for_answers_while_stays_pay_and_retries_now_and_then() {
        let t = Instant::now();
        let mut w = AnswerWatch::default();
        assert_eq!(w.stay(), None, "not watching");
        w.arm(t);
        assert_eq!(w.stay(), Some(ANSWER_STAY));
        w.stayed(true, t);
        assert!(!w.armed(), "found: the watch ends");
        w.arm(t);
        assert_eq!(w.stay(), Some(ANSWER_STAY));
        w.stayed(false, t);
        assert!(w.armed(), "not found: the looks go on");
        // a stay that did not pay: the next STAY_RETRY - 1 deliveries sleep at once
        for _ in 1..STAY_RETRY {
            w.arm(t);
            assert_eq!(w.stay(), None);
        }
        w.arm(t);
        assert_eq!(w.stay(), Some(ANSWER_STAY));
    }

    #[test]
    fn an_answer_watch_that_finds_nothing_gives_up_then_watches_now_and_then() {
        let mut t = Instant::now();
        let mut w = AnswerWatch::default();
        let fruitless = |w: &mut AnswerWatch, t: &mut Instant| {
            let mut looks = 0;
            while w.armed() {
                *t += w.wait(*t, Duration::from_secs(1));
                assert!(w.due(*t));
                let gave_up = w.looked(false, *t);
                looks += 1;
                assert_eq!(gave_up, !w.armed());
            }
            looks
        };
        w.arm(t);
        // 4, 8, 16, 32, 64, 128 µs
        assert_eq!(fruitless(&mut w, &mut t), 6);
        for _ in 1..COLD_AFTER {
            w.arm(t);
            assert_eq!(fruitless(&mut w, &mut t), 6);
        }
        // COLD_AFTER fruitless watches: the next delivery is passed over; one more, two
        for skipped in 1..=2 {
            for _ in 0..skipped {
                w.arm(t);
                assert!(!w.armed());
            }
            w.arm(t);
            assert!(w.armed());
            fruitless(&mut w, &mut t);
        }
        w.arm(t);
        assert!(!w.armed());
        for _ in 0..3 {
            w.arm(t);
        }
        assert!(w.armed());
        // a find starts over: every delivery watched again
        assert!(!w.looked(true, t));
        w.arm(t);
        assert!(w.armed());
        w.disarm();
        assert!(!w.armed());
    }

    #[test]
    fn a_spinner_that_found_its_core_shared_spins_again_after_a_while() {
        let now = Instant::now();
        let s = Spinner {
            contended_until: Some(now + CONTENDED_MIN),
            penalty: CONTENDED_MIN,
        };
        assert!(!s.may_spin(now));
        assert!(s.may_spin(now + CONTENDED_MIN));
        assert!(Spinner::default().may_spin(now));
    }

    #[test]
    fn a_core_found_shared_again_and_again_keeps_the_spinner_off_longer_each_time() {
        let t0 = Instant::now();
        let mut s = Spinner::default();
        s.found_shared(t0);
        assert_eq!(s.penalty, CONTENDED_MIN);
        // found again right after the first penalty: twice as long, and so on up to the cap
        let mut t = t0 + CONTENDED_MIN;
        for _ in 0..10 {
            let before = s.penalty;
            s.found_shared(t);
            assert_eq!(s.penalty, (before * 2).min(CONTENDED_MAX));
            assert!(!s.may_spin(t));
            t += s.penalty;
        }
        assert_eq!(s.penalty, CONTENDED_MAX);
        // a quiet spell as long as the penalty: the next find starts short again
        s.found_shared(t + 2 * CONTENDED_MAX);
        assert_eq!(s.penalty, CONTENDED_MIN);
    }
}
