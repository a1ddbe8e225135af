//! What the latency tests report: what a run of one size did on this process's sides ([`Ran`]:
//! round trips, messages sent), and perftest's latency columns and their widths, for counted
//! runs and for runs of a duration (`-D`).

/// perftest's latency columns and their widths (its RESULT_FMT_LAT's spacing).
pub(super) const LAT_COLUMNS: [(&str, usize); 9] = [
    ("#bytes", 6),
    ("#iterations", 14),
    ("t_min[usec]", 14),
    ("t_max[usec]", 12),
    ("t_typical[usec]", 18),
    ("t_avg[usec]", 14),
    ("t_stdev[usec]", 15),
    ("99% percentile[usec]", 22),
    ("99.9% percentile[usec]", 0),
];

/// perftest's columns in duration mode (-D; `RESULT_FMT_LAT_DUR`).
pub(super) const LAT_DUR_COLUMNS: [(&str, usize); 4] = [
    ("#bytes", 13),
    ("#iterations", 17),
    ("t_avg[usec]", 14),
    ("tps average", 0),
];

/// What a run of one size did on this process's sides.
#[derive(Clone, Debug, Default)]
pub(super) struct Ran {
    /// Side A's round trips in ns, every one, warm-up included (counted runs, side A here).
    pub(super) rtt: Option<Vec<u64>>,
    /// Messages (WRITEs, SENDs, READs, atomics) each side of this process sent, by side.
    pub(super) sent: [Option<u64>; 2],
    /// With -D: side A's timed round trips and their span in ns (side A here).
    pub(super) timed: Option<(u64, u64)>,
}
