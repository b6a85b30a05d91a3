//! Figures from per-iteration times: percentiles, averages, bandwidth, message rate.

use std::time::Duration;

/// One MB as `ucx_perftest` prints it: 2^20 bytes.
pub const MB: f64 = 1024.0 * 1024.0;

/// The `p`-th percentile (0..=100) of sorted values, interpolating linearly between the two
/// closest ranks; `None` for no values.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() || !(0.0..=100.0).contains(&p) {
        return None;
    }
    let pos = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Median of unsorted values (sorts a copy).
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// The figures of one test at one size, as `ucx_perftest` reports them.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    /// Test name.
    pub test: String,
    /// Message size in bytes.
    pub size: usize,
    /// Measured iterations.
    pub iterations: usize,
    /// Latency, 50th percentile of iterations, microseconds.
    pub lat_p50_us: f64,
    /// Latency, mean of iterations, microseconds.
    pub lat_avg_us: f64,
    /// Latency, whole run divided by iterations, microseconds.
    pub lat_overall_us: f64,
    /// Bandwidth from the mean iteration, MB/s (2^20 bytes).
    pub bw_avg_mbs: f64,
    /// Bandwidth over the whole run, MB/s.
    pub bw_overall_mbs: f64,
    /// Messages per second from the mean iteration.
    pub mr_avg: f64,
    /// Messages per second over the whole run.
    pub mr_overall: f64,
}

impl Figures {
    /// Compute from per-iteration times (`samples`, in any order) and the whole run's time.
    /// Ping-pong tests halve the times (one way); bandwidth and message rate follow the
    /// one-way time, as in `ucx_perftest`.
    pub fn compute(
        test: &str,
        size: usize,
        samples: &[Duration],
        total: Duration,
        pingpong: bool,
    ) -> Figures {
        let factor = if pingpong { 0.5 } else { 1.0 };
        let mut us: Vec<f64> = samples
            .iter()
            .map(|d| d.as_secs_f64() * 1e6 * factor)
            .collect();
        us.sort_by(f64::total_cmp);
        let n = us.len();
        let p50 = percentile(&us, 50.0).unwrap_or(0.0);
        let avg = if n == 0 {
            0.0
        } else {
            us.iter().sum::<f64>() / n as f64
        };
        let overall = if n == 0 {
            0.0
        } else {
            total.as_secs_f64() * 1e6 * factor / n as f64
        };
        let rate = |t_us: f64| if t_us > 0.0 { 1e6 / t_us } else { 0.0 };
        Figures {
            test: test.to_string(),
            size,
            iterations: n,
            lat_p50_us: p50,
            lat_avg_us: avg,
            lat_overall_us: overall,
            bw_avg_mbs: rate(avg) * size as f64 / MB,
            bw_overall_mbs: rate(overall) * size as f64 / MB,
            mr_avg: rate(avg),
            mr_overall: rate(overall),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn percentiles() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 50.0), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 50.0), Some(2.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), Some(2.5));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.0), Some(1.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 100.0), Some(4.0));
        assert_eq!(percentile(&[0.0, 10.0], 25.0), Some(2.5));
        assert_eq!(percentile(&[1.0], 101.0), None);
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        assert_eq!(median(&[f64::NAN, 2.0]), Some(2.0));
    }

    #[test]
    fn figures_of_a_pingpong_and_a_stream() {
        let us = Duration::from_micros;
        // Round trips of 2, 4, 6 us: one way 1, 2, 3.
        let f = Figures::compute("tag_lat", 8, &[us(6), us(2), us(4)], us(15), true);
        assert_eq!(f.iterations, 3);
        assert!((f.lat_p50_us - 2.0).abs() < 1e-9);
        assert!((f.lat_avg_us - 2.0).abs() < 1e-9);
        assert!((f.lat_overall_us - 2.5).abs() < 1e-9);
        assert!((f.mr_avg - 500_000.0).abs() < 1e-3);
        assert!((f.bw_avg_mbs - 8.0 * 500_000.0 / MB).abs() < 1e-9);
        // 4 messages of 1 MiB in 4 ms: 1000 MB/s overall.
        let f = Figures::compute("tag_bw", 1 << 20, &[us(1000); 4], us(4000), false);
        assert!((f.bw_overall_mbs - 1000.0).abs() < 1e-9);
        assert!((f.mr_overall - 1000.0).abs() < 1e-9);
        let f = Figures::compute("tag_bw", 8, &[], Duration::ZERO, false);
        assert_eq!(
            (f.iterations, f.lat_avg_us, f.bw_overall_mbs),
            (0, 0.0, 0.0)
        );
    }

    proptest! {
        #[test]
        fn percentile_is_within_range_and_monotone(
            mut v in proptest::collection::vec(0.0f64..1e6, 1..200),
            p in 0.0f64..100.0,
            q in 0.0f64..100.0,
        ) {
            v.sort_by(f64::total_cmp);
            let a = percentile(&v, p).unwrap();
            prop_assert!(a >= v[0] && a <= v[v.len() - 1]);
            let (lo, hi) = if p <= q { (p, q) } else { (q, p) };
            prop_assert!(percentile(&v, lo).unwrap() <= percentile(&v, hi).unwrap());
        }
    }
}
