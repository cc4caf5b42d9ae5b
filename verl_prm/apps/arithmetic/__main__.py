from verl_prm.apps.arithmetic.pipeline import main

raise SystemExit(main())
