from verl_prm.recipes.arithmetic.pipeline import main

raise SystemExit(main())
