//! Placeholder until the transport's benchmarks land.
use criterion::{Criterion, criterion_group, criterion_main};

fn nothing(_c: &mut Criterion) {}

criterion_group!(benches, nothing);
criterion_main!(benches);
