use super::*;

fn d(entries: &[(&str, &str)], hits: Option<u64>) -> Descriptor {
    Descriptor {
        entries: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        hits_addend: hits,
    }
}

#[test]
fn parses_budgets() {
    assert_eq!(
        Budget::parse("tenant=team-a:100").unwrap(),
        Budget { key: "tenant".into(), value: "team-a".into(), limit: 100, used: 0 }
    );
    // The value may hold a colon (a model name, an address); the limit is after the last.
    assert_eq!(Budget::parse("model=a:b:7").unwrap().value, "a:b");
    for bad in ["tenant", "tenant=a", "=a:1", "tenant=a:x", "tenant=a:-1"] {
        assert!(Budget::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_check_charges_nothing_and_a_charge_spends_the_budget() {
    let mut l = Ledger::new(vec![Budget::parse("tenant=a:10").unwrap()]);
    let check = [d(&[("tenant", "a")], Some(0))];
    assert_eq!(l.apply(&check, 0), vec![Verdict { over_limit: false, hits: 0, budget: Some((10, 0)) }]);
    // Charges 9, then 1: spent at 10, not before.
    l.apply(&[d(&[("tenant", "a")], Some(9))], 0);
    assert!(!l.apply(&check, 0)[0].over_limit);
    l.apply(&[d(&[("tenant", "a")], Some(1))], 0);
    assert_eq!(l.apply(&check, 0)[0], Verdict { over_limit: true, hits: 0, budget: Some((10, 10)) });
}

#[test]
fn hits_default_to_the_request_then_one_and_unbudgeted_descriptors_pass() {
    let mut l = Ledger::new(vec![Budget::parse("tenant=a:2").unwrap()]);
    let v = l.apply(&[d(&[("tenant", "a")], None), d(&[("done", "x")], None)], 0);
    assert_eq!(v[0].hits, 1);
    assert_eq!(v[1], Verdict { over_limit: false, hits: 1, budget: None });
    assert_eq!(l.apply(&[d(&[("tenant", "a")], None)], 5)[0].hits, 5);
    // Another tenant has no budget: never over.
    assert!(!l.apply(&[d(&[("tenant", "b")], Some(0))], 0)[0].over_limit);
    assert!(l.apply(&[d(&[("tenant", "a")], Some(0))], 0)[0].over_limit);
}
