"""Operating what was deployed: gate verdicts and `moeflow watch`, live expert load and
`moeflow rebalance`."""
