// dist/cjs holds CommonJS: mark it so for Node (the package itself is "type": "module").
import { writeFileSync } from 'node:fs'
writeFileSync('dist/cjs/package.json', JSON.stringify({ type: 'commonjs' }) + '\n')
