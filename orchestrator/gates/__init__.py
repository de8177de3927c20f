"""Server-side gates: auth, booking eligibility, manifest, confirmations,
validation, cost and plan."""
